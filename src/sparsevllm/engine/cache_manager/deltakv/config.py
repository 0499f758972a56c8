"""DeltaKV's knobs and the arithmetic of its schedule and storage: when compression runs, how many
tokens a request keeps raw, and how a memory budget splits into full-layer pages and raw slots."""
import math
import os
from dataclasses import dataclass

import torch

from sparsevllm.config import EngineConfig, MethodConfig, is_int, is_number
from sparsevllm.engine.cache_manager.deltakv import compressor as dc
from sparsevllm.engine.kv_pool import bytes_per_token_head, kv_storage_dtype


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
        need = self.need
        f = self.deltakv_full_layers
        if f is not None:
            need(isinstance(f, (list, tuple)) and len(f) > 0 and all(is_int(x) and x >= 0 for x in f)
                 and list(f) == sorted(set(f)) and f[0] == 0, "deltakv_full_layers",
                 "None (the paper's 0, 1, 2, 8, 18 of 32, scaled) or a strictly increasing list of layer ids "
                 "starting with 0 (a full layer must score tokens before the first sparse layer)")
            self.deltakv_full_layers = list(f)
        ld = self.deltakv_latent_dim
        need(ld is None or (is_int(ld) and ld > 0), "deltakv_latent_dim", "None (the compressor's) or an integer > 0")
        if not hasattr(self, "unset"):   # the knobs left None, once (validate may run again on this object)
            self.unset = [k for k in FROM_COMPRESSOR if getattr(self, k) is None]
        for knob in self.unset:
            if getattr(self, knob) is None:   # the default until validate_model reads the compressor
                setattr(self, knob, FROM_COMPRESSOR[knob][1])
        cr = self.deltakv_cluster_ratio
        need(is_number(cr) and 0 < cr < 1, "deltakv_cluster_ratio",
             "a number in (0, 1)")
        need(is_int(self.deltakv_neighbors) and self.deltakv_neighbors >= 1, "deltakv_neighbors", "an integer >= 1")
        need(is_int(self.deltakv_sink) and self.deltakv_sink >= 1, "deltakv_sink",
             "an integer >= 1 (every compressed token needs an earlier reference)")
        need(is_int(self.deltakv_recent) and self.deltakv_recent >= 1, "deltakv_recent", "an integer >= 1")
        need(is_int(self.deltakv_decode_keep) and self.deltakv_decode_keep >= 1, "deltakv_decode_keep",
             "an integer >= 1")
        need(is_int(self.deltakv_compress_windows) and self.deltakv_compress_windows >= 1,
             "deltakv_compress_windows", "an integer >= 1")
        need(is_int(self.deltakv_compress_steps) and 1 <= self.deltakv_compress_steps <= self.deltakv_recent,
             "deltakv_compress_steps", "an integer in [1, deltakv_recent] (1: every layer in the step that "
             "starts it)")
        path = self.deltakv_compressor_path
        if path is None:
            if engine.load_format != "dummy":
                raise ValueError("deltakv_compressor_path is required: DeltaKV needs a trained compressor; train one "
                                 "with `python -m sparsevllm.tools.train_deltakv --model MODEL --out DIR` (or use "
                                 "load_format='dummy' for a random one in speed runs)")
        elif not os.path.isfile(os.path.join(str(path), dc.CONFIG)):
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

def sizes(config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> dict:
    """Bytes of each store, per token or fixed; the one formula behind sizing and accounting."""
    knobs = config.method_config
    full = knobs.deltakv_full_layers or dc.default_full_layers(num_layers)
    n_full, n_sparse = len(full), num_layers - len(full)
    elt = torch.empty((), dtype=dtype).element_size()
    # one token's K + V in one layer as stored (FP8: a byte an element and the scales), and as rebuilt
    token = 2 * num_kv_heads * bytes_per_token_head(head_dim, kv_storage_dtype(config.kv_cache_dtype, dtype))
    rebuilt = 2 * num_kv_heads * head_dim * elt
    latent = n_sparse * ((knobs.deltakv_latent_dim or 128) * elt + 4 * knobs.deltakv_neighbors)
    # Raw slots no request can do without: a prefill step's new tokens (raw until its end), and every
    # running request's sink and raw tail. Scratch: the decode views of a full batch, and the
    # reconstructed prefix of a prefill chunk (one layer of max_model_len tokens, made per step).
    fixed_raw = config.max_num_batched_tokens + config.max_num_seqs * (knobs.deltakv_sink + knobs.tail_bound + 1)
    scratch = (config.max_num_seqs * knobs.view_capacity + config.max_model_len) * rebuilt
    return dict(n_full=n_full, n_sparse=n_sparse, token=token, steady=n_full * token + latent
                + n_sparse * token / knobs.stride, raw_slot=n_sparse * token, fixed_raw=fixed_raw,
                fixed=fixed_raw * n_sparse * token + scratch, scratch=scratch, latent=latent)


def bytes_per_page(config: EngineConfig, num_layers, num_kv_heads, head_dim, dtype) -> int:
    """A page's steady-state bytes (full layers raw, the sparse layers' latents, a 1/s share of
    raw references) plus its share of the fixed raw room and scratch, amortised over the pages
    the runner may give (max_num_seqs x max_model_len tokens); split_budget takes the fixed part
    off the top, so a smaller pool never exceeds its budget."""
    s = sizes(config, num_layers, num_kv_heads, head_dim, dtype)
    useful = config.max_num_seqs * config.max_model_len
    return math.ceil(config.page_size * (s["steady"] + s["fixed"] / useful))


def split_budget(config: EngineConfig, num_pages: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype) -> tuple[int, int]:
    """The runner's num_pages x bytes_per_page -> (full-layer pages, raw slots): the fixed raw room
    and the scratch come off the top, the rest is pages at their steady-state bytes, and raw slots
    are the pages' references plus the fixed room (never more than every token raw)."""
    P, s = config.page_size, sizes(config, num_layers, num_kv_heads, head_dim, dtype)
    total = num_pages * bytes_per_page(config, num_layers, num_kv_heads, head_dim, dtype)
    pages = int((total - s["fixed"]) // (P * s["steady"]))
    if pages < 1:   # a pool too small to amortise the fixed room (a tiny explicit num_kv_pages)
        pages = num_pages
    stride = config.method_config.stride
    return pages, max(1, min(pages * P + config.max_num_seqs, math.ceil(pages * P / stride) + s["fixed_raw"]))

