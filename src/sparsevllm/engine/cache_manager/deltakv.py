"""deltakv: residual latent compression of old tokens with a trained compressor (DeltaKV, arXiv
2602.08005; the authors' engine is the upstream Sparse-vLLM).

What it computes. Full layers (`deltakv_full_layers`, default the paper's 0, 1, 2, 8, 18 of 32
scaled to the depth as round(f * L / 32), layer 0 always) keep every token raw. In the other
(sparse) layers the first `deltakv_sink` tokens and the recent window stay raw; older tokens are
compressed in blocks of whole windows as they age out: references (the sink and every s-th token
after it, s = round(1 / cluster_ratio)) stay raw, every other token t keeps only
z_t = down(x_t) - down(r_t), x_t = [K_t before RoPE ; V_t], r_t the mean of its
`deltakv_neighbors` nearest earlier references (L2), and the positions of those references; its
raw slot is freed. Each decode step, the full layer just before a run of sparse layers scores every
token (raw logits, max over query heads: a fused output of its own attention, as in OmniKV); the
first sparse layer of the run picks the top `deltakv_decode_keep` compressed tokens; every sparse
layer of the run rebuilds them (up(z) + r, RoPE at the true position) into scratch slots with the
sink and the raw tail, and attends to that (a page-size-1 decode view). All of it is tensor work
inside the CUDA graph.

Storage (the layout is this method's own):
- the paged pool of the base class, over the full layers only, with per slot the sparse layers'
  latents and reference positions beside it (a token's latent lives at its full-layer slot);
- a raw pool for the sparse layers with one-token slots: a token holds a slot until it is
  compressed, references and the sink forever; the slot allocator is a free stack on the host;
  room for one prefill step's new tokens and every request's sink and raw tail is reserved;
- per running request, a device row mapping position -> raw slot (-1: compressed), which the
  decode kernels read inside graphs;
- one scratch of max_num_seqs x (sink + decode_keep + raw tail) token slots, shared by the sparse
  layers (each fills it just before its attention); a prefill chunk's rebuilt prefix (one layer,
  made per step) is counted as max_model_len more.
Admission and `bytes_per_page` count exactly these.

When compression runs: in `on_step_end`, after every step (prefill chunks included), for a request
whose raw tail has reached `deltakv_compress_windows` + 1 windows (default 2): the oldest whole
windows are compressed, leaving one window raw; the requests of one step are compressed together,
as one padded batch. Bookkeeping is planned on the host from counters the host knows; the device
work (gathers, nearest references, the GEMMs) is queued after the step's forward and never
synchronises. A prefill chunk's compression runs at its step's end; a decode step's runs its
sparse layers in `deltakv_compress_steps` shares, one in each step that decodes its requests from
the one that starts it (host launches of ~2.5 ms a layer hide behind the forwards that way; prefill
steps between do not count), and its tokens stay raw, in the decode view's tail, until the last
share; a request freed meanwhile leaves it, the others' goes on.
Prefill is chunked: a chunk after the first attends (densely, unchanged math otherwise) to its
prefix as the sparse layers hold it, the compressed tokens rebuilt into a per-step scratch, as the
compressor was trained (attention over reconstructed KV). So a long prompt never sits raw in the
sparse layers beyond one chunk and its raw tail.

Deviations:
- Prefix caching is off (capabilities): a hit would share full-layer pages but not the sparse
  layers' raw slots and latents.
- The sparse layers' raw pool stores K after RoPE (prefill attention reads it); compression and
  reconstruction rotate references back by their positions (exact up to rounding).
- Qwen3's k-norm runs in the model before the cache hook, so the engine compresses the normed K
  (the paper: K before the norm, re-normed after reconstruction); the trainer learns on the same
  normed K, and no k-norm is applied again after reconstruction.
- up(z) and down(x) run as cuBLAS GEMMs (torch modules); the Triton kernels do the gathers, the
  reference means, the rotations and the scratch writes.
- Prefill compresses chunk by chunk, so a chunk after the first reads the compressed part of its
  prefix rebuilt from the latents rather than raw (this is what bounds a long prompt's raw memory).
  So outputs depend on the schedule: where a prompt's chunks end (a step's token budget shared
  with other prompts) decides which of its tokens later chunks read rebuilt.
- Preemption recomputes prompt + generated tokens by chunked prefill: the generated tokens then
  attend to their whole prefix (compressed part rebuilt), not to the decode view (sink + top
  decode_keep + raw tail) they attended to when generated, so a preempted request's continuation
  can differ from an uninterrupted run. With async_scheduling a tight pool can preempt where the
  synchronous engine does not (a finished request's extra step holds its pages a step longer),
  and it admits a prompt a step later, so where a step's token budget cuts chunks short they can
  end elsewhere; without preemption and with whole chunks the two give the same tokens (tested).
- The nearest references are ranked in fp32, a chunk of tokens at a time. On the GPU, when each
  request compresses at most 512 tokens (decode steps), a bf16 GEMM first shortlists 32 candidates a
  token and only those are ranked in fp32 (the fp32 GEMM against every reference was ~half of a
  128K x 4 decode compression); a true neighbour is lost only if bf16 rounding moves 32 others past
  it.
"""
import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from sparsevllm import deltakv_compressor as dc
from sparsevllm.config import EngineConfig, MethodConfig
from sparsevllm.engine.cache_manager.base import CacheManager, Capabilities
from sparsevllm.engine.kv_pool import KVPool, PageAllocator, PageTables
from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.staging import HostStaging, to_device
from sparsevllm.engine.step import DecodeView, PrefillView, StepState
from sparsevllm.forward_context import get_forward_context
from sparsevllm.kernels.deltakv import compress_block, gather_x, reconstruct, shortlist, up_of
from sparsevllm.kernels.rope_store import rope_store
from sparsevllm.kernels.token_select import select_tokens
from sparsevllm.models.config import ModelConfig

logger = logging.getLogger(__name__)
COMPRESS_CHUNK = 8192   # tokens compressed together: [8192, 2 H D] fp32 + [8192, refs] distances
COMPRESS_REFS = 65536   # references a compression batch gathers: [65536, 2 H D] fp32 (512 MiB at 8 x 128)
SHORTLIST = 32          # GPU: candidates a token keeps from the bf16 ranking, then ranked exactly in fp32
REF_BUCKET = 1024       # GPU decode windows: references padded to a multiple (see _plan)
TOKEN_BUCKET = 64       # GPU decode windows: tokens padded to a multiple (see _plan)
SHORTLIST_TOKENS = 512  # GPU: the most tokens a request may compress for the shortlist, and tokens shortlisted
                        # together: [512, 32, 2 H D] fp32 candidates (64 MiB at 8 x 128)
PREFIX_PIECE = 16384    # prefix tokens rebuilt together for a prefill chunk: bounds the up(z) GEMM's output


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# Knobs that define the reference structure a compressor was trained on: None takes the compressor's
# value (its compressor.json records it), else the paper's default; a value that differs is kept, with
# a warning (the latents were trained against other references).
FROM_COMPRESSOR = {"deltakv_cluster_ratio": ("cluster_ratio", 0.1), "deltakv_neighbors": ("neighbors", 4),
                   "deltakv_sink": ("sink", 8)}


@dataclass
class DeltaKVConfig(MethodConfig):
    deltakv_compressor_path: str | None = None     # a folder from `python -m sparsevllm.tools.train_deltakv`
    deltakv_full_layers: list[int] | None = None   # None: the compressor's, else 0,1,2,8,18 of 32 scaled
    deltakv_latent_dim: int | None = None          # None: the compressor's (128 for a dummy one)
    deltakv_cluster_ratio: float | None = None     # references: every round(1 / ratio)-th token (None: below)
    deltakv_neighbors: int | None = None           # references averaged into r_t (None: below)
    deltakv_sink: int | None = None                # first tokens, raw and references (None: below)
    deltakv_recent: int = 128                      # raw window; compression moves in blocks of it
    deltakv_decode_keep: int = 2048                # compressed tokens reconstructed per decode step
    deltakv_compress_windows: int = 1              # windows a decode-time compression takes at once
    deltakv_compress_steps: int = 16               # decode steps a decode-time compression is spread over

    def validate(self, engine: EngineConfig) -> None:
        def need(ok, knob, valid):
            if not ok:
                raise ValueError(f"{knob}={getattr(self, knob)!r} is invalid; valid: {valid}")
        f = self.deltakv_full_layers
        if f is not None:
            need(isinstance(f, (list, tuple)) and len(f) > 0 and all(_is_int(x) and x >= 0 for x in f)
                 and list(f) == sorted(set(f)) and f[0] == 0, "deltakv_full_layers",
                 "None (the paper's 0, 1, 2, 8, 18 of 32, scaled) or a strictly increasing list of layer ids "
                 "starting with 0 (a full layer must score tokens before the first sparse layer)")
            self.deltakv_full_layers = list(f)
        ld = self.deltakv_latent_dim
        need(ld is None or (_is_int(ld) and ld > 0), "deltakv_latent_dim", "None (the compressor's) or an integer > 0")
        if not hasattr(self, "unset"):   # the knobs left None, once (validate may run again on this object)
            self.unset = [k for k in FROM_COMPRESSOR if getattr(self, k) is None]
        for knob in self.unset:
            if getattr(self, knob) is None:   # the default until validate_model reads the compressor
                setattr(self, knob, FROM_COMPRESSOR[knob][1])
        cr = self.deltakv_cluster_ratio
        need(isinstance(cr, (int, float)) and not isinstance(cr, bool) and 0 < cr < 1, "deltakv_cluster_ratio",
             "a number in (0, 1)")
        need(_is_int(self.deltakv_neighbors) and self.deltakv_neighbors >= 1, "deltakv_neighbors", "an integer >= 1")
        need(_is_int(self.deltakv_sink) and self.deltakv_sink >= 1, "deltakv_sink",
             "an integer >= 1 (every compressed token needs an earlier reference)")
        need(_is_int(self.deltakv_recent) and self.deltakv_recent >= 1, "deltakv_recent", "an integer >= 1")
        need(_is_int(self.deltakv_decode_keep) and self.deltakv_decode_keep >= 1, "deltakv_decode_keep",
             "an integer >= 1")
        need(_is_int(self.deltakv_compress_windows) and self.deltakv_compress_windows >= 1,
             "deltakv_compress_windows", "an integer >= 1")
        need(_is_int(self.deltakv_compress_steps) and 1 <= self.deltakv_compress_steps <= self.deltakv_recent,
             "deltakv_compress_steps", "an integer in [1, deltakv_recent] (1: every layer in the step that "
             "starts it)")
        path = self.deltakv_compressor_path
        if path is None:
            if engine.load_format != "dummy":
                raise ValueError("deltakv_compressor_path is required: DeltaKV needs a trained compressor; train one "
                                 "with `python -m sparsevllm.tools.train_deltakv --model MODEL --out DIR` (or use "
                                 "load_format='dummy' for a random one in speed runs)")
        else:
            import os
            if not os.path.isfile(os.path.join(str(path), dc.CONFIG)):
                raise ValueError(f"deltakv_compressor_path={path!r} holds no {dc.CONFIG}; train a compressor with "
                                 "`python -m sparsevllm.tools.train_deltakv --model MODEL --out DIR`")

    @property
    def stride(self) -> int:
        return max(1, round(1.0 / self.deltakv_cluster_ratio))

    @property
    def max_tail(self) -> int:
        """The raw tail's bound: compression runs once it holds deltakv_compress_windows + 1 windows
        and leaves one (a compression event reads every reference of the request, so more windows a
        time means fewer of those passes, at the price of raw memory and attention over the tail)."""
        return (self.deltakv_compress_windows + 1) * self.deltakv_recent

    @property
    def tail_bound(self) -> int:
        """The most raw tail tokens a request holds: a decode-time compression starts at max_tail and
        its tokens stay raw until its last layer is done, up to compress_steps - 1 steps later."""
        return self.max_tail + self.deltakv_compress_steps - 1

    def spread(self, num_sparse_layers: int) -> int:
        """Steps a decode-time compression takes: its sparse layers in equal shares, one share a step."""
        return max(1, min(self.deltakv_compress_steps, num_sparse_layers))

    def compress_to(self, comp_end: int, length: int) -> int:
        """The rule of a step's end: once the raw tail reaches max_tail, every whole window of it but
        the last is compressed."""
        w = self.deltakv_recent
        return comp_end if length - comp_end < self.max_tail else comp_end + (length - w - comp_end) // w * w

    def compressed_until(self, prompt_len: int, length: int, spread: int = 1) -> int:
        """Where the compressed part ends once a request of prompt_len tokens holds `length`: the rule
        at the prompt's end, then decode's compress_windows windows each time the tail fills, taking
        effect `spread` - 1 steps later (see DeltaKVConfig.spread)."""
        w, m = self.deltakv_recent, self.deltakv_compress_windows
        end = self.compress_to(self.deltakv_sink, min(prompt_len, length))
        if length - end >= self.max_tail + spread - 1:
            end += ((length - end - self.max_tail - spread + 1) // (m * w) + 1) * m * w
        return end

    @property
    def view_capacity(self) -> int:
        """Decode-view entries per request: sink + selected + the raw tail."""
        return self.deltakv_sink + self.deltakv_decode_keep + self.tail_bound + 1


def layer_roles(num_layers: int, full_layers: list[int]) -> list[tuple[str, int]]:
    """Per layer ("full", scores?) or ("sparse", the full layer whose scores it uses)."""
    roles, last = [], 0
    for layer in range(num_layers):
        if layer in full_layers:
            roles.append(("full", int(layer + 1 < num_layers and layer + 1 not in full_layers)))
            last = layer
        else:
            roles.append(("sparse", last))
    return roles


def _sizes(config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> dict:
    """Bytes of each store, per token or fixed; the one formula behind sizing and accounting."""
    knobs = config.method_config
    full = knobs.deltakv_full_layers or dc.default_full_layers(num_layers)
    n_full, n_sparse = len(full), num_layers - len(full)
    elt = torch.empty((), dtype=dtype).element_size()
    token = 2 * num_kv_heads * head_dim * elt                      # one token's K + V in one layer
    latent = n_sparse * ((knobs.deltakv_latent_dim or 128) * elt + 4 * knobs.deltakv_neighbors)
    # Raw slots no request can do without: a prefill step's new tokens (raw until its end), and every
    # running request's sink and raw tail. Scratch: the decode views of a full batch, and the
    # reconstructed prefix of a prefill chunk (one layer of max_model_len tokens, made per step).
    fixed_raw = config.max_num_batched_tokens + config.max_num_seqs * (knobs.deltakv_sink + knobs.tail_bound + 1)
    scratch = (config.max_num_seqs * knobs.view_capacity + config.max_model_len) * token
    return dict(n_full=n_full, n_sparse=n_sparse, token=token, steady=n_full * token + latent
                + n_sparse * token / knobs.stride, raw_slot=n_sparse * token, fixed_raw=fixed_raw,
                fixed=fixed_raw * n_sparse * token + scratch, scratch=scratch, latent=latent)


def split_budget(config: EngineConfig, num_pages: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype) -> tuple[int, int]:
    """The runner's num_pages x bytes_per_page -> (full-layer pages, raw slots): the fixed raw room
    and the scratch come off the top, the rest is pages at their steady-state bytes, and raw slots
    are the pages' references plus the fixed room (never more than every token raw)."""
    P, s = config.page_size, _sizes(config, num_layers, num_kv_heads, head_dim, dtype)
    total = num_pages * DeltaKVCacheManager.bytes_per_page(config, num_layers, num_kv_heads, head_dim, dtype)
    pages = int((total - s["fixed"]) // (P * s["steady"]))
    if pages < 1:   # a pool too small to amortise the fixed room (a tiny explicit num_kv_pages)
        pages = num_pages
    stride = config.method_config.stride
    return pages, max(1, min(pages * P + config.max_num_seqs, math.ceil(pages * P / stride) + s["fixed_raw"]))


class _SlotStack:
    """One-token raw slots: a free stack on the host (numpy, so a 128K-token prompt is one slice)."""

    def __init__(self, num_slots: int):
        self.free = np.arange(num_slots - 1, -1, -1, dtype=np.int32)
        self.top = num_slots
        self.num_slots = num_slots
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return self.top

    def take(self, n: int) -> np.ndarray:
        assert n <= self.top
        self.top -= n
        self.peak_used = max(self.peak_used, self.num_slots - self.top)
        return self.free[self.top:self.top + n][::-1].copy()

    def give(self, slots: np.ndarray) -> None:
        self.free[self.top:self.top + len(slots)] = slots
        self.top += len(slots)


class _Request:
    def __init__(self, row: int, max_len: int, sink: int):
        self.row = row
        self.slots = np.full(max_len + 1, -1, dtype=np.int32)   # raw slot per position, -1: none
        self.upto = 0                                           # positions [0, upto) got a raw slot
        self.comp_end = sink                                    # [sink, comp_end) is compressed
        self.prompt_end = 0                                     # its prompt's length
        self.event: _Event | None = None                        # its decode-time compression under way
        self.dropped = False                                    # freed while that was under way


class _Plan(NamedTuple):
    """One request's part of a compression: its token and reference positions, the latent slots its
    tokens take, and where its compressed prefix ends once the event finishes."""
    req: _Request
    tok_pos: np.ndarray
    ref_pos: np.ndarray
    l_slots: np.ndarray
    end: int


def _kept(plans: list[_Plan], n: int, live) -> tuple[np.ndarray, np.ndarray]:
    """The live requests' real tokens as flat indices into the padded [B, n] batch, and the latent
    slots they take."""
    keep = np.concatenate([b * n + np.arange(len(plans[b].tok_pos)) for b in live])
    return keep, np.concatenate([plans[b].l_slots for b in live])


class _Event:
    """A compression planned once and run a share of the sparse layers at a time: the requests'
    plans, their device tensors (see _plan), the layers done."""

    def __init__(self, plans: list[_Plan], tensors: dict):
        self.plans, self.tensors = plans, tensors
        self.steps_done = 0
        self.layers_done = 0


class DeltaKVCacheManager(CacheManager):
    method_name = "deltakv"
    config_cls = DeltaKVConfig
    # Not under tensor parallelism: the compressor maps all KV heads of a token together ([K; V] of
    # every head -> one latent), so a rank owning some heads cannot compress its part alone.
    capabilities = Capabilities(prefix_cache=False, tensor_parallel=False)

    def __init__(self, config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_pages: int, dtype: torch.dtype, device: torch.device):
        # Not CacheManager.__init__: its pool would hold every layer raw.
        self.config, self.method_config = config, config.method_config
        knobs = self.method_config
        self.page_size = P = config.page_size
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.device, self.dtype = device, dtype
        compressor = self._compressor()
        self.full_layers = knobs.deltakv_full_layers
        self.roles = layer_roles(num_layers, self.full_layers)
        self.sparse_layers = [i for i in range(num_layers) if self.roles[i][0] == "sparse"]
        self.index = {layer: i for group in (self.full_layers, self.sparse_layers) for i, layer in enumerate(group)}
        self.codecs = [compressor.layers[str(layer)] for layer in self.sparse_layers]
        self.latent_dim = compressor.config["latent_dim"]

        pages, raw_slots = split_budget(config, num_pages, num_layers, num_kv_heads, head_dim, dtype)
        logger.info("deltakv: %d full layers raw in %d pages of %d tokens, %d sparse layers with %d raw slots "
                    "and latents of %d dims", len(self.full_layers), pages, P, len(self.sparse_layers), raw_slots,
                    self.latent_dim)
        self.pool = KVPool(len(self.full_layers), pages, P, num_kv_heads, head_dim, dtype, device)
        self.raw = KVPool(len(self.sparse_layers), raw_slots, 1, num_kv_heads, head_dim, dtype, device)
        n_sp = len(self.sparse_layers)
        self.latents = torch.zeros(n_sp, pages * P, self.latent_dim, dtype=dtype, device=device)
        self.neighbors = torch.full((n_sp, pages * P, knobs.deltakv_neighbors), -1, dtype=torch.int32, device=device)
        self.allocator = PageAllocator(pages)
        self.tables = PageTables(self.allocator, P, self.pages_for(config.max_model_len) + 1, False)
        self.staging = HostStaging(torch.device(device))
        self.raw_slots = _SlotStack(raw_slots)
        self.max_len = config.max_model_len
        self.raw_map = torch.full((config.max_num_seqs + 1, self.max_len + 1), -1, dtype=torch.int32, device=device)
        self.free_rows = list(range(config.max_num_seqs, -1, -1))
        self.requests: dict[int, _Request] = {}
        self.compressed_mark = torch.full((), -1, dtype=torch.int32, device=device)
        self.spread = knobs.spread(len(self.sparse_layers))
        self.events: list[_Event] = []   # decode-time compressions under way, oldest first
        cap = knobs.view_capacity
        self.scratch_k = torch.zeros(config.max_num_seqs * cap, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.scratch_v = torch.zeros_like(self.scratch_k)
        self.view_slots = torch.arange(config.max_num_seqs * cap, dtype=torch.int32, device=device).view(-1, 1, cap)
        width = (self.pages_for(config.max_model_len) + 1) * P
        self.positions = torch.arange(width, dtype=torch.int32, device=device).view(1, width)
        self.cos_sin = None   # the rotary table, seen at the first store_kv
        # bf16 shortlist before the exact ranking of decode-time compressions, where bf16 GEMMs are
        # fast (tests force it on CPU)
        self.shortlist = torch.device(device).type == "cuda"

    def _compressor(self) -> dc.DeltaKVCompressor:
        knobs = self.method_config
        model_config = getattr(knobs, "_model_config", None)
        if knobs.deltakv_compressor_path is not None:
            comp = dc.load(knobs.deltakv_compressor_path, model_config)
        else:   # load_format="dummy": a random compressor of the configured shape, for speed runs
            torch.manual_seed(self.config.seed)
            cfg = dc.make_config(model_config, latent_dim=knobs.deltakv_latent_dim or 128,
                                 cluster_ratio=knobs.deltakv_cluster_ratio, neighbors=knobs.deltakv_neighbors,
                                 sink=knobs.deltakv_sink, full_layers=knobs.deltakv_full_layers)
            comp = dc.DeltaKVCompressor(cfg)
        return comp.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)

    # ---- knobs against the model, sizing, cost model ----------------------------------------
    @classmethod
    def validate_model(cls, config: EngineConfig, model_config: ModelConfig) -> None:
        knobs, n = config.method_config, model_config.num_hidden_layers
        knobs._model_config = model_config   # the cache manager builds its compressor from it
        f = knobs.deltakv_full_layers
        if f is not None and f[-1] >= n:
            raise ValueError(f"deltakv_full_layers={f} is out of range for a model of {n} layers; valid: layer ids "
                             f"in [0, {n - 1}] starting with 0")
        if knobs.deltakv_compressor_path is None:
            knobs.deltakv_full_layers = f or dc.default_full_layers(n)
            return
        import json
        import os
        with open(os.path.join(knobs.deltakv_compressor_path, dc.CONFIG)) as fh:
            cfg = json.load(fh)
        try:
            dc.validate_config(cfg)
        except ValueError as e:
            raise ValueError(f"deltakv_compressor_path={knobs.deltakv_compressor_path!r}: {e}") from None
        want = {"architecture": model_config.architecture, "num_hidden_layers": n,
                "hidden_size": model_config.hidden_size, "num_key_value_heads": model_config.num_key_value_heads,
                "head_dim": model_config.head_dim}
        wrong = [f"{k}: compressor {cfg.get(k)!r}, model {v!r}" for k, v in want.items() if cfg.get(k) != v]
        if wrong:
            raise ValueError(f"deltakv_compressor_path={knobs.deltakv_compressor_path!r} was trained for another "
                             "model shape (" + "; ".join(wrong) + ")")
        full = f or sorted(set(range(n)) - set(cfg["layers"]))
        missing = sorted(set(range(n)) - set(full) - set(cfg["layers"]))
        if missing or not full or full[0] != 0:
            raise ValueError(f"deltakv_full_layers={full}: the compressor has no codec for sparse layers {missing}"
                             if missing else f"deltakv_full_layers={full} must start with layer 0")
        if knobs.deltakv_latent_dim is not None and knobs.deltakv_latent_dim != cfg["latent_dim"]:
            raise ValueError(f"deltakv_latent_dim={knobs.deltakv_latent_dim} contradicts the compressor's latent dim "
                             f"{cfg['latent_dim']}; leave it None to use the compressor's")
        knobs.deltakv_full_layers, knobs.deltakv_latent_dim = full, cfg["latent_dim"]
        for knob, (key, _) in FROM_COMPRESSOR.items():
            if knob in getattr(knobs, "unset", ()):
                setattr(knobs, knob, cfg[key])
            elif getattr(knobs, knob) != cfg[key]:
                logger.warning("%s=%r differs from the %r the compressor was trained with (%s); the latents "
                               "were fitted against other references", knob, getattr(knobs, knob), cfg[key],
                               knobs.deltakv_compressor_path)

    @classmethod
    def bytes_per_page(cls, config: EngineConfig, num_layers, num_kv_heads, head_dim, dtype) -> int:
        """A page's steady-state bytes (full layers raw, the sparse layers' latents, a 1/s share of
        raw references) plus its share of the fixed raw room and scratch, amortised over the pages
        the runner may give (max_num_seqs x max_model_len tokens); __init__ takes the fixed part
        off the top, so a smaller pool never exceeds its budget."""
        s = _sizes(config, num_layers, num_kv_heads, head_dim, dtype)
        useful = config.max_num_seqs * config.max_model_len
        return math.ceil(config.page_size * (s["steady"] + s["fixed"] / useful))

    @classmethod
    def _roofline_shape(cls, config: EngineConfig, model_config: ModelConfig) -> tuple[int, int, int]:
        """(full layers, sparse layers, one token's K + V elements in one layer: the unit a latent of
        latent_dim elements is counted in)."""
        full = config.method_config.deltakv_full_layers
        n = model_config.num_hidden_layers
        n_full = len(full) if full else len(dc.default_full_layers(n))
        return n_full, n - n_full, 2 * model_config.num_key_value_heads * model_config.head_dim

    @classmethod
    def decode_kv_tokens_read(cls, config: EngineConfig, model_config: ModelConfig, prompt_len: int,
                              cache_len: int) -> float:
        """Full layers read the whole cache; a sparse layer reads the sink, the raw tail, and per
        reconstructed token its latent and its int32 neighbour ids (two 16-bit elements each) and its
        references (distinct references at most)."""
        knobs = config.method_config
        n_full, n_sparse, width = cls._roofline_shape(config, model_config)
        sink = knobs.deltakv_sink
        compressed = knobs.compressed_until(prompt_len, cache_len, knobs.spread(n_sparse)) - sink
        kept = min(knobs.deltakv_decode_keep, compressed)
        refs = min(kept * knobs.deltakv_neighbors, sink + compressed // knobs.stride)
        latent_tokens = kept * ((knobs.deltakv_latent_dim or 128) + 2 * knobs.deltakv_neighbors) / width
        sparse = cache_len - compressed + kept + refs + latent_tokens
        return (n_full * cache_len + n_sparse * sparse) / (n_full + n_sparse)

    @classmethod
    def kv_tokens_held(cls, config: EngineConfig, model_config: ModelConfig, prompt_len: int,
                       output_len: int) -> int | None:
        """Raw-token equivalents at the end of a request: full layers everything, sparse layers the
        raw sink, tail and references, latents at latent_dim / (2 H_kv D) of a token."""
        knobs = config.method_config
        n_full, n_sparse, width = cls._roofline_shape(config, model_config)
        total = prompt_len + output_len
        compressed = max(0, total - knobs.deltakv_sink - knobs.max_tail)
        latent_share = (knobs.deltakv_latent_dim or 128) / width
        per_sparse = total - compressed + compressed / knobs.stride + compressed * latent_share
        return math.ceil((n_full * total + n_sparse * per_sparse) / (n_full + n_sparse))

    # ---- capacity and lifecycle --------------------------------------------------------------
    def can_admit(self, seq: Sequence) -> bool:
        # Raw room for its references, its sink and raw tail and one chunk, after the references
        # the prompts still prefilling will keep (else their next chunk would preempt them).
        knobs = self.method_config
        stride = knobs.stride
        pending = sum(max(0, r.prompt_end - r.upto) // stride for r in self.requests.values())
        # The cap is every token raw: a short prompt's references are among its raw tokens, so they
        # must not be counted again (that failed prompts that fit a small pool).
        # A chunk is at most one step's token budget too (what split_budget reserves).
        chunk = min(self.config.chunk_prefill_size, self.config.max_num_batched_tokens)
        admit_len = self.seq_admit_len(seq)
        need = min(admit_len, knobs.deltakv_sink + knobs.tail_bound + chunk + len(seq) // stride)
        return (bool(self.free_rows) and self.raw_slots.num_free - pending >= need
                and self.pages_for(admit_len) <= self.allocator.num_free)

    def allocate(self, seq: Sequence) -> None:
        self.tables.open(seq, [])
        req = self.requests[seq.seq_id] = _Request(self.free_rows.pop(), self.max_len, self.method_config.deltakv_sink)
        req.prompt_end = len(seq)
        seq.num_computed_tokens = seq.cache_len = 0

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        req = self.requests[seq.seq_id]
        end = seq.cache_len + num_new_tokens
        need = max(0, end - req.upto)
        if need > self.raw_slots.num_free or not self.tables.grow(seq, end):
            return False
        req.slots[req.upto:end] = self.raw_slots.take(need)
        req.upto = max(req.upto, end)
        return True

    def free(self, seq: Sequence) -> None:
        self.tables.close(seq)
        req = self.requests.pop(seq.seq_id, None)
        if req is not None:
            if req.event is not None:
                self._drop(req)
            held = req.slots[:req.upto]
            self.raw_slots.give(held[held >= 0])
            self.free_rows.append(req.row)

    def memory_accounting(self) -> dict:
        P, n_sp = self.page_size, len(self.sparse_layers)
        page_bytes = (self.pool.nbytes + self.latents.nbytes + self.neighbors.nbytes) // self.num_pages
        slot_bytes = self.raw.nbytes // self.raw_slots.num_slots
        used_pages = self.num_pages - self.allocator.num_free
        used_slots = self.raw_slots.num_slots - self.raw_slots.num_free
        fixed = self.scratch_k.nbytes * 2 + self.raw_map.nbytes
        return {"kv_pool_bytes": self.pool.nbytes + self.latents.nbytes + self.neighbors.nbytes + self.raw.nbytes
                + fixed,
                "kv_used_bytes": used_pages * page_bytes + used_slots * slot_bytes + fixed,
                "kv_peak_used_bytes": self.allocator.peak_used * page_bytes + self.raw_slots.peak_used * slot_bytes
                + fixed,
                "kv_page_bytes": page_bytes, "num_pages": self.num_pages, "used_pages": used_pages,
                "raw_slot_bytes": slot_bytes, "raw_slots": self.raw_slots.num_slots, "used_raw_slots": used_slots,
                "full_layers_bytes": self.pool.nbytes, "sparse_raw_bytes": self.raw.nbytes,
                "latent_bytes": self.latents.nbytes + self.neighbors.nbytes, "scratch_bytes": 2 * self.scratch_k.nbytes,
                "metadata_bytes": self.latents.nbytes + self.neighbors.nbytes + self.raw_map.nbytes,
                "sparse_layers": n_sp, "page_size": P}

    # ---- per step ----------------------------------------------------------------------------
    def prepare_step(self, seqs: list[Sequence], num_tokens: list[int], is_prefill: bool,
                     feed_rows: list[int] | None = None) -> StepState:
        step = super().prepare_step(seqs, num_tokens, is_prefill, feed_rows)
        reqs = [self.requests[s.seq_id] for s in seqs]
        raw = np.concatenate([r.slots[s.cache_len:s.cache_len + n] for r, s, n in zip(reqs, seqs, num_tokens)])
        rows = np.repeat([r.row for r in reqs], num_tokens)
        host = np.concatenate([raw, rows, [r.row for r in reqs], [r.comp_end for r in reqs]]).astype(np.int64)
        dev = to_device(host, self.device)
        T, B = len(raw), len(reqs)
        raw_slots, token_rows = dev[:T], dev[T:2 * T]
        # New tokens' raw slots enter the device map before the forward (stream order).
        self.raw_map[token_rows, step.positions] = raw_slots.to(torch.int32)
        step.extras["deltakv_raw_slots"] = raw_slots
        step.extras["deltakv_rows"] = dev[2 * T:2 * T + B]
        self._prefix = None
        if is_prefill:
            width = max(s.cache_len + n for s, n in zip(seqs, num_tokens))
            step.extras["deltakv_raw_tables"] = self.raw_map[step.extras["deltakv_rows"], :width].contiguous()
            if any(r.comp_end > self.method_config.deltakv_sink for r in reqs):
                # Some chunk attends to a compressed prefix: each sparse layer rebuilds the whole
                # prefix (+ the chunk) into one scratch, request after request.
                lens = [s.cache_len + n for s, n in zip(seqs, num_tokens)]
                offsets = np.cumsum([0] + lens[:-1])
                self._prefix = (lens, offsets.tolist(),
                                self.positions[:, :width] + to_device(offsets, self.device, torch.int32).view(-1, 1))
        else:
            step.extras["deltakv_comp_end"] = dev[2 * T + B:].to(torch.int32)
        return step

    def graph_extras(self, max_batch_size: int) -> dict[str, torch.Tensor]:
        # Padding rows: no raw write (their slot mapping is -1 anyway), row 0, nothing compressed.
        n, dev = max_batch_size, self.device
        return {"deltakv_raw_slots": torch.full((n,), -1, dtype=torch.int64, device=dev),
                "deltakv_rows": torch.zeros(n, dtype=torch.int64, device=dev),
                "deltakv_comp_end": torch.full((n,), self.method_config.deltakv_sink, dtype=torch.int32, device=dev)}

    # ---- per layer ---------------------------------------------------------------------------
    def store_kv(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cos_sin_cache: torch.Tensor, step: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        self.cos_sin = cos_sin_cache
        i = self.index[layer_id]
        if self.roles[layer_id][0] == "full":
            k_cache, v_cache = self.pool.layer(i)
            return rope_store(q, k, v, step.positions, cos_sin_cache, k_cache, v_cache, step.slot_mapping)
        slots = torch.where(step.slot_mapping >= 0, step.extras["deltakv_raw_slots"], -1)
        k_cache, v_cache = self.raw.layer(i)
        return rope_store(q, k, v, step.positions, cos_sin_cache, k_cache, v_cache, slots)

    def prefill_view(self, layer_id: int, step: StepState) -> PrefillView:
        i = self.index[layer_id]
        if self.roles[layer_id][0] == "full":
            k_cache, v_cache = self.pool.layer(i)
            return PrefillView(k_cache, v_cache, step.block_tables, step.cache_lens, self.page_size)
        k_cache, v_cache = self.raw.layer(i)
        if self._prefix is None:   # nothing compressed yet: the raw slots are the prefix
            return PrefillView(k_cache, v_cache, step.extras["deltakv_raw_tables"], step.cache_lens, 1)
        lens, offsets, table = self._prefix
        out_k = torch.empty(sum(lens), self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
        out_v = torch.empty_like(out_k)
        P, codec = self.page_size, self.codecs[i]
        rows = step.extras["deltakv_rows"]
        for b, (length, off) in enumerate(zip(lens, offsets)):
            for a in range(0, length, PREFIX_PIECE):
                m = min(PREFIX_PIECE, length - a)
                pos = self.positions[0, a:a + m].long()
                latent_slots = step.block_tables[b].long()[pos // P] * P + pos % P
                up_z = up_of(codec.up, self.latents[i], latent_slots).view(1, m, -1)
                reconstruct(pos.view(1, m).to(torch.int32), torch.full((1,), m, dtype=torch.int32, device=self.device),
                            rows[b:b + 1], self.raw_map, k_cache, v_cache, up_z.contiguous(), self.neighbors[i],
                            latent_slots.view(1, m), 0, self.cos_sin, out_k[off + a:off + a + m],
                            out_v[off + a:off + a + m])
        return PrefillView(out_k, out_v, table, step.cache_lens, 1)

    def build_decode_view(self, layer_id: int, q: torch.Tensor, step: StepState) -> DecodeView:
        role, arg = self.roles[layer_id]
        controller = get_forward_context().controller
        if role == "full":
            k_cache, v_cache = self.pool.layer(self.index[layer_id])
            view = DecodeView(k_cache, v_cache, step.block_tables.unsqueeze(1), step.cache_lens.unsqueeze(1),
                              self.page_size)
            if arg:   # the next layer is sparse: this layer's attention scores every token for it
                view.token_scores = torch.empty(q.shape[0], self.num_kv_heads,
                                                step.block_tables.shape[1] * self.page_size,
                                                dtype=torch.float32, device=q.device)
                controller.put(f"deltakv.{layer_id}", view.token_scores)   # [B, H_kv, T]: max over groups below
            return view
        chosen = controller.get(f"deltakv.{arg}")
        if isinstance(chosen, torch.Tensor):   # first sparse layer of the run: select once for the run
            chosen = self._select(chosen.amax(dim=1), step)
            controller.put(f"deltakv.{arg}", chosen)
        view_pos, lengths, latent_slots = chosen
        i = self.index[layer_id]
        B = view_pos.shape[0]
        up_z = up_of(self.codecs[i].up, self.latents[i], latent_slots)              # [B, keep, 2 H D]
        k_cache, v_cache = self.raw.layer(i)
        # the kernel reads each token's references through its latent slot (no gather launch)
        reconstruct(view_pos, lengths, step.extras["deltakv_rows"], self.raw_map, k_cache, v_cache, up_z.contiguous(),
                    self.neighbors[i], latent_slots, self.method_config.deltakv_sink, self.cos_sin, self.scratch_k,
                    self.scratch_v)
        return DecodeView(self.scratch_k, self.scratch_v, self.view_slots[:B], lengths.view(B, 1), 1)

    def _select(self, scores: torch.Tensor, step: StepState):
        """Top decode_keep compressed tokens by the full layer's scores -> the run's view positions
        [B, cap] (sink, selected in logical order, raw tail), their lengths and the selected
        tokens' latent slots [B, keep]."""
        knobs = self.method_config
        sink, keep, cap = knobs.deltakv_sink, knobs.deltakv_decode_keep, knobs.view_capacity
        B, T = scores.shape
        if T <= sink:   # (eager, contexts within the sink) nothing can be compressed yet
            scores = torch.nn.functional.pad(scores, (0, sink + 1 - T), value=float("-inf"))
            T = sink + 1
        lens = step.cache_lens.long()
        comp_end = step.extras["deltakv_comp_end"].long().clamp(min=sink)
        comp_end = torch.minimum(comp_end, torch.maximum(lens, torch.full_like(lens, sink)))   # padding rows
        n_comp = (comp_end - sink).to(torch.int32)
        table, n_sel = select_tokens(scores[:, sink:], torch.full_like(n_comp, keep), self.positions[:, :T - sink]
                                     .expand(B, T - sink), n_comp, n_comp, 1)
        n_sel = n_sel.view(B).long()
        sel = table[:, 0, :keep].long()
        if sel.shape[1] < keep:
            sel = torch.nn.functional.pad(sel, (0, keep - sel.shape[1]))
        # The Triton select leaves entries past a row's count unwritten: never gather through them.
        sel = torch.where(torch.arange(keep, device=sel.device).view(1, keep) < n_sel.view(B, 1), sel, 0) + sink
        j = torch.arange(cap, device=scores.device).view(1, cap)
        picked = sel.gather(1, (j - sink).clamp(0, keep - 1).expand(B, cap))
        tail = comp_end.view(B, 1) + j - sink - n_sel.view(B, 1)
        view_pos = torch.where(j < sink, j, torch.where(j < sink + n_sel.view(B, 1), picked, tail))
        lengths = (lens - (comp_end - sink) + n_sel).clamp(1, cap).to(torch.int32)
        P = self.page_size
        sel = sel.clamp(max=step.block_tables.shape[1] * P - 1)
        latent_slots = step.block_tables.long().gather(1, sel // P) * P + sel % P
        return view_pos.to(torch.int32).contiguous(), lengths, latent_slots

    # ---- compression -------------------------------------------------------------------------
    def on_step_end(self, step: StepState) -> None:
        jobs = []
        for seq, n in zip(step.seqs, step.num_tokens):
            req = self.requests[seq.seq_id]
            end = self.method_config.compress_to(req.comp_end, seq.cache_len + n)
            if end > req.comp_end and req.event is None:
                jobs.append((seq, req, req.comp_end, end))
        # Decode steps age out one window in many requests at once: compress those together (one
        # launch sequence a layer; one request at a time cost a 128K x 4 decode step 153 ms on the
        # H200, host-bound, against 48 ms batched). Groups bound the transient tensors: tokens x
        # references for the scores, references x F for their features; a prefill chunk goes alone.
        sink, stride = self.method_config.deltakv_sink, self.method_config.stride
        spread = 1 if step.is_prefill else self.spread
        jobs.sort(key=lambda job: job[3] - job[2])
        group, most_tokens, most_refs = [], 0, 0
        for job in jobs:
            tokens, refs = job[3] - job[2], sink + -(-(job[3] - sink) // stride)
            most_tokens, most_refs = max(most_tokens, tokens), max(most_refs, refs)
            grown = len(group) + 1
            if group and (grown * most_tokens > COMPRESS_CHUNK or grown * most_refs > COMPRESS_REFS):
                self._compress(group, spread)
                group, most_tokens, most_refs = [], tokens, refs
            group.append(job)
        if group:
            self._compress(group, spread)
        # A decode-time compression runs a share of the sparse layers each step: its ~65 launches a
        # layer cost the host ~2.5 ms a layer (a 128K x 4 event: 65-71 ms of host time for 21 ms of
        # GPU work on the H200), which overlapped scheduling hides behind the next forward only a
        # share at a time. Its tokens stay raw (and in the decode view's tail) until the last share.
        # Shares go with the steps that decode its requests, not prefill steps between them: where
        # prefills fall differs with overlapped scheduling (it admits a step later), the number of
        # tokens a request decodes before its compression takes effect must not.
        if not step.is_prefill and self.events:
            under_way = {id(self.requests[seq.seq_id].event) for seq in step.seqs}
            for event in [e for e in self.events if id(e) in under_way]:
                self._advance(event)

    def _compress(self, jobs: list[tuple[Sequence, _Request, int, int]], spread: int = 1) -> None:
        """Compress positions [start, end) of each (seq, req, start, end) in every sparse layer and
        free their raw slots (references keep theirs): now (spread 1), or a share of the layers in
        each of the next `spread` decode steps of its requests, this one included."""
        event = _Event(*self._plan(jobs))
        if spread == 1:
            self._run_layers(event, len(self.codecs))
            self._finish_event(event)
            return
        for _, req, _, _ in jobs:
            req.event = event
        self.events.append(event)

    def _advance(self, event: _Event) -> None:
        event.steps_done += 1
        self._run_layers(event, event.steps_done * len(self.codecs) // self.spread)
        if event.steps_done == self.spread:
            self.events.remove(event)
            self._finish_event(event)

    def _drop(self, req: _Request) -> None:
        """A request freed while its compression is under way: the other requests' compression goes
        on unchanged (the same steps with or without overlapped scheduling, which frees a step later);
        its own latents are no longer written (its pages may go to another request)."""
        event, req.event, req.dropped = req.event, None, True
        live = [b for b, p in enumerate(event.plans) if not p.req.dropped]
        if not live:
            self.events.remove(event)
            return
        t = event.tensors
        keep, l_slots = _kept(event.plans, t["t_key"].shape[1], live)
        t["keep"], t["l_slots"] = torch.split(to_device(np.concatenate([keep, l_slots]), self.device),
                                              [len(keep), len(l_slots)])

    @torch.inference_mode()
    def _plan(self, jobs: list[tuple[Sequence, _Request, int, int]]) -> tuple[list[_Plan], dict]:
        """Host planning from host counters and the device tensors every layer reuses; queued after
        the forward, no synchronisation. The requests are padded to one batch: padding tokens sit at
        position -1 (no earlier reference: nothing chosen, nothing stored), padding references after
        every token (never chosen); both read a real slot at position 0."""
        knobs = self.method_config
        sink, stride, P = knobs.deltakv_sink, knobs.stride, self.page_size
        plans = []
        for seq, req, start, end in jobs:
            pos = np.arange(start, end)
            tok_pos = pos[(pos - sink) % stride != 0]
            ref_pos = np.concatenate([np.arange(sink), np.arange(sink, end, stride)])
            table = self.tables.arrays[seq.seq_id]
            plans.append(_Plan(req, tok_pos, ref_pos, table[tok_pos // P].astype(np.int64) * P + tok_pos % P, end))
        B = len(plans)
        n, R = max(len(p.tok_pos) for p in plans), max(len(p.ref_pos) for p in plans)
        # Chunks of tokens bound the transient [B, chunk, F] and [B, chunk, R] tensors (a 128K prompt
        # is compressed at once), and each chunk is compared only with the references before it.
        # The shortlist pays where a pass over every reference serves few tokens (a decode step's
        # windows). A prefill chunk's thousands of tokens keep the full fp32 ranking: one dense GEMM
        # beats 16 shortlist rounds of candidate gathers (with the shortlist there too, 128K x 4
        # prefill fell from 5,200 to 4,700 tok/s on the H200).
        short = self.shortlist and n <= SHORTLIST_TOKENS
        c = max(1, (SHORTLIST_TOKENS if short else COMPRESS_CHUNK) // B)
        if short:
            # Decode windows padded so the GEMM shapes repeat from event to event: the first cuBLAS
            # call of a new shape costs the host 12-13 ms (the shortlist's [B, n, F] x [B, F, refs],
            # 128K x 4 on the H200, profiled), at every event's first layer as the references grow.
            # Padding tokens sit at position -1 and padding references after every token: never
            # chosen. No chunk is padding only (n stays within the chunks the real tokens need).
            n = min(-(-n // TOKEN_BUCKET) * TOKEN_BUCKET, -(-n // c) * c)
            R = -(-R // REF_BUCKET) * REF_BUCKET
        t_slots, r_slots = np.zeros((B, n), np.int64), np.zeros((B, R), np.int64)
        t_key, r_key = np.full((B, n), -1, np.int64), np.full((B, R), 1 << 40, np.int64)
        for b, (req, tok_pos, ref_pos, _, _) in enumerate(plans):
            t_slots[b], r_slots[b] = req.slots[ref_pos[0]], req.slots[ref_pos[0]]
            t_slots[b, :len(tok_pos)], t_key[b, :len(tok_pos)] = req.slots[tok_pos], tok_pos
            r_slots[b, :len(ref_pos)], r_key[b, :len(ref_pos)] = req.slots[ref_pos], ref_pos
        host = [t_slots.ravel(), t_key.ravel(), r_slots.ravel(), r_key.ravel(), *_kept(plans, n, range(B))]
        parts = torch.split(to_device(np.concatenate(host), self.device), [len(h) for h in host])
        t_slots_d, t_key_d, r_slots_d, r_key_d = (t.view(B, -1) for t in parts[:4])
        t_rot, r_rot = t_key_d.clamp(min=0), r_key_d.where(r_key_d < (1 << 40), 0)   # rotation positions
        # Per chunk, what every layer reuses: the tokens' slots and rotations, flattened once.
        chunks = []
        for a in range(0, n, c):
            e = min(a + c, n)
            nref = max(int(np.searchsorted(p.ref_pos, p.tok_pos[min(e, len(p.tok_pos)) - 1]))
                       for p in plans if a < len(p.tok_pos))
            nref = min(R, -(-nref // REF_BUCKET) * REF_BUCKET) if short else nref
            chunks.append((a, e, nref, t_slots_d[:, a:e].flatten(), t_rot[:, a:e].flatten()))
        ref_meta = torch.stack([r_slots_d, r_rot, r_key_d]) if short else None   # one gather a layer picks all three
        return plans, dict(t_key=t_key_d, r_slots=r_slots_d, r_rot=r_rot, r_key=r_key_d, keep=parts[4],
                           l_slots=parts[5], chunks=chunks, short=short, ref_meta=ref_meta)

    @torch.inference_mode()
    def _run_layers(self, event: _Event, upto: int) -> None:
        """Compress the event's tokens in sparse layers [layers_done, upto)."""
        t, knobs = event.tensors, self.method_config
        B, R = t["r_key"].shape
        short, t_key_d, r_key_d = t["short"], t["t_key"], t["r_key"]
        for i in range(event.layers_done, upto):
            codec = self.codecs[i]
            k_cache, v_cache = self.raw.layer(i)
            refs = gather_x(k_cache, v_cache, t["r_slots"].flatten(), t["r_rot"].flatten(), self.cos_sin,
                            torch.bfloat16 if short else torch.float32).view(B, R, -1)
            if short:
                ref_sq = torch.linalg.vector_norm(refs, dim=-1, dtype=torch.float32).square()   # no fp32 copy of refs
            zs, nbrs = [], []
            for a, e, nref, slots, rot in t["chunks"]:
                x = gather_x(k_cache, v_cache, slots, rot, self.cos_sin).view(B, e - a, -1)
                if short:   # each token's candidates, gathered again in fp32
                    idx = shortlist(x, refs[:, :nref], ref_sq[:, :nref], r_key_d[:, :nref], t_key_d[:, a:e],
                                    SHORTLIST)
                    c_slots, c_rot, c_key = t["ref_meta"].gather(2, idx.flatten(1).expand(3, -1, -1))
                    cand = gather_x(k_cache, v_cache, c_slots.flatten(), c_rot.flatten(),
                                    self.cos_sin).view(*idx.shape, -1)
                    z, nbr = compress_block(x, cand, c_key.view(idx.shape), t_key_d[:, a:e],
                                            knobs.deltakv_neighbors, codec)
                else:
                    z, nbr = compress_block(x, refs[:, :nref], r_key_d[:, :nref], t_key_d[:, a:e],
                                            knobs.deltakv_neighbors, codec)
                zs.append(z)
                nbrs.append(nbr)
            keep, l_slots = t["keep"], t["l_slots"]
            z = torch.cat(zs, 1).flatten(0, 1)[keep]
            self.latents[i][l_slots] = z.to(self.latents.dtype)
            self.neighbors[i][l_slots] = torch.cat(nbrs, 1).flatten(0, 1)[keep]
        event.layers_done = upto

    @torch.inference_mode()
    def _finish_event(self, event: _Event) -> None:
        """Every layer holds the latents: mark the tokens compressed and free their raw slots. At
        least one request is live (_drop ends an event whose requests all left)."""
        live = [(p.req, p.tok_pos, p.end) for p in event.plans if not p.req.dropped]
        rows = np.concatenate([np.full(len(tok_pos), req.row) for req, tok_pos, _ in live])
        pos = np.concatenate([tok_pos for _, tok_pos, _ in live])
        dev = to_device(np.concatenate([rows, pos]).astype(np.int64), self.device)
        # A device-side -1: `raw_map[...] = -1` copies the scalar from pageable host memory, which
        # waits for the queued forward (~12 ms a 128K x 4 decode step on the H200, under overlap).
        self.raw_map.index_put_((dev[:len(rows)], dev[len(rows):]), self.compressed_mark)
        for req, tok_pos, end in live:
            self.raw_slots.give(req.slots[tok_pos])
            req.slots[tok_pos] = -1
            req.event, req.comp_end = None, end
