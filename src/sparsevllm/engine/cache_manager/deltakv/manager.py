"""DeltaKVCacheManager: DeltaKV's storage, admission, per-step inputs and decode views (the package
docstring says what the method computes; compression.py runs the compression)."""
import logging
import math

import numpy as np
import torch

from sparsevllm.config import EngineConfig
from sparsevllm.engine.cache_manager.base import CacheManager, Capabilities
from sparsevllm.engine.cache_manager.cross_layer import layer_roles, scored_view, selection
from sparsevllm.engine.cache_manager.deltakv import compressor as dc
from sparsevllm.engine.cache_manager.deltakv import config as schedule
from sparsevllm.engine.cache_manager.deltakv.compression import Compression, Event, Request
from sparsevllm.engine.cache_manager.deltakv.config import FROM_COMPRESSOR, DeltaKVConfig, split_budget
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.staging import to_device
from sparsevllm.engine.step import DecodeView, PrefillView, StepState
from sparsevllm.kernels.deltakv import reconstruct, up_of
from sparsevllm.kernels.token_select import select_tokens
from sparsevllm.kernels.rope_store import rope_store
from sparsevllm.models.config import ModelConfig

logger = logging.getLogger(__name__)
PREFIX_PIECE = 16384    # prefix tokens rebuilt together for a prefill chunk: bounds the up(z) GEMM's output


class SlotStack:
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


class DeltaKVCacheManager(Compression, CacheManager):
    method_name = "deltakv"
    config_cls = DeltaKVConfig
    recall_definition = ("against its rebuilt keys: per sparse layer, the share of the softmax mass over every token "
                         "the request holds, compressed tokens rebuilt from their latents as its prefill attends "
                         "them (per query head, averaged over heads), on the decode view (sink, selected rebuilt "
                         "tokens, raw tail); full layers are dense and not measured")
    # Not under tensor parallelism: the compressor maps all KV heads of a token together ([K; V] of
    # every head -> one latent), so a rank owning some heads cannot compress its part alone.
    capabilities = Capabilities(prefix_cache=False, tensor_parallel=False)

    def allocate_storage(self, num_pages: int) -> int:
        """Full layers raw in pages, the sparse layers' latents and neighbour ids beside them, and a
        raw pool of one-token slots for the sparse layers (split_budget divides the budget)."""
        knobs, P, dtype, device = self.method_config, self.page_size, self.dtype, self.device
        compressor = self._compressor()
        self.full_layers = knobs.deltakv_full_layers
        # A full layer scores the tokens for the sparse layers after it (OmniKV's filter layer).
        self.roles = layer_roles(self.num_layers, self.full_layers)
        self.sparse_layers = [i for i, (role, _) in enumerate(self.roles) if role == "sparse"]
        self.index = {layer: i for group in (self.full_layers, self.sparse_layers) for i, layer in enumerate(group)}
        self.codecs = [compressor.layers[str(layer)] for layer in self.sparse_layers]
        self.latent_dim = compressor.config["latent_dim"]
        pages, raw_slots = split_budget(self.config, num_pages, self.num_layers, self.num_kv_heads, self.head_dim,
                                        dtype)
        logger.info("deltakv: %d full layers raw in %d pages of %d tokens, %d sparse layers with %d raw slots "
                    "and latents of %d dims", len(self.full_layers), pages, P, len(self.sparse_layers), raw_slots,
                    self.latent_dim)
        # An FP8 cache stores the full layers and the raw slots in FP8 with their scales; the latents
        # and the scratch of rebuilt tokens stay in the model dtype (the compressor's own output).
        kv = self.kv_dtype
        self.pool = KVPool(len(self.full_layers), pages, P, self.num_kv_heads, self.head_dim, kv, device)
        self.raw = KVPool(len(self.sparse_layers), raw_slots, 1, self.num_kv_heads, self.head_dim, kv, device)
        n_sp = len(self.sparse_layers)
        self.latents = torch.zeros(n_sp, pages * P, self.latent_dim, dtype=dtype, device=device)
        self.neighbors = torch.full((n_sp, pages * P, knobs.deltakv_neighbors), -1, dtype=torch.int32, device=device)
        self.raw_slots = SlotStack(raw_slots)
        return pages

    def __init__(self, *args):
        super().__init__(*args)
        config, knobs, device = self.config, self.method_config, self.device
        self.max_len = config.max_model_len
        self.raw_map = torch.full((config.max_num_seqs + 1, self.max_len + 1), -1, dtype=torch.int32, device=device)
        self.free_rows = list(range(config.max_num_seqs, -1, -1))
        self.requests: dict[int, Request] = {}
        self.compressed_mark = torch.full((), -1, dtype=torch.int32, device=device)
        self.spread = knobs.spread(len(self.sparse_layers))
        self.events: list[Event] = []   # decode-time compressions under way, oldest first
        cap = knobs.view_capacity
        self.scratch_k = torch.zeros(config.max_num_seqs * cap, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                                     device=device)
        self.scratch_v = torch.zeros_like(self.scratch_k)
        self.view_slots = torch.arange(config.max_num_seqs * cap, dtype=torch.int32, device=device).view(-1, 1, cap)
        width = (self.pages_for(config.max_model_len) + 1) * self.page_size
        self.positions = torch.arange(width, dtype=torch.int32, device=device).view(1, width)
        self.cos_sin = None   # the rotary table, seen at the first store_kv
        # bf16 shortlist before the exact ranking of decode-time compressions, where bf16 GEMMs are
        # fast (tests force it on CPU)
        self.shortlist = torch.device(device).type == "cuda"

    def _compressor(self) -> dc.DeltaKVCompressor:
        knobs = self.method_config
        if knobs.deltakv_compressor_path is not None:
            comp = dc.load(knobs.deltakv_compressor_path, self.model_config)
        else:   # load_format="dummy": a random compressor of the configured shape, for speed runs
            torch.manual_seed(self.config.seed)
            cfg = dc.make_config(self.model_config, latent_dim=knobs.deltakv_latent_dim or 128,
                                 cluster_ratio=knobs.deltakv_cluster_ratio, neighbors=knobs.deltakv_neighbors,
                                 sink=knobs.deltakv_sink, full_layers=knobs.deltakv_full_layers)
            comp = dc.DeltaKVCompressor(cfg)
        return comp.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)

    # ---- knobs against the model, sizing, cost model ----------------------------------------
    @classmethod
    def validate_model(cls, config: EngineConfig, model_config: ModelConfig) -> None:
        knobs, n = config.method_config, model_config.num_hidden_layers
        f = knobs.deltakv_full_layers
        if f is not None and f[-1] >= n:
            raise ValueError(f"deltakv_full_layers={f} is out of range for a model of {n} layers; valid: layer ids "
                             f"in [0, {n - 1}] starting with 0")
        if knobs.deltakv_compressor_path is None:
            knobs.deltakv_full_layers = f or dc.default_full_layers(n)
            return
        cfg = dc.read_config(knobs.deltakv_compressor_path, model_config)
        weak = dc.training_warning(cfg)
        if weak:
            logger.warning("deltakv_compressor_path=%r looks under-trained: %s. DeltaKV's accuracy is its "
                           "compressor's: train it longer (python -m sparsevllm.tools.train_deltakv --out DIR "
                           "--resume --steps N) and check it with --evaluate", knobs.deltakv_compressor_path, weak)
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
        return schedule.bytes_per_page(config, num_layers, num_kv_heads, head_dim, dtype)

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
        req = self.requests[seq.seq_id] = Request(self.free_rows.pop(), self.max_len, self.method_config.deltakv_sink)
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
    def on_step_begin(self, step: StepState) -> None:
        seqs, num_tokens = step.seqs, step.num_tokens
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
        if not step.is_prefill:
            step.extras["deltakv_comp_end"] = dev[2 * T + B:].to(torch.int32)
            return
        width = max(s.cache_len + n for s, n in zip(seqs, num_tokens))
        step.extras["deltakv_raw_tables"] = self.raw_map[step.extras["deltakv_rows"], :width].contiguous()
        if any(r.comp_end > self.method_config.deltakv_sink for r in reqs):
            # Some chunk attends to a compressed prefix: each sparse layer rebuilds the whole
            # prefix (+ the chunk) into one scratch, request after request.
            lens = [s.cache_len + n for s, n in zip(seqs, num_tokens)]
            offsets = np.cumsum([0] + lens[:-1])
            step.scratch["deltakv.prefix"] = (
                lens, offsets.tolist(), self.positions[:, :width] + to_device(offsets, self.device, torch.int32).view(-1, 1))

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
        if self.roles[layer_id][0] == "filter":
            k_cache, v_cache = self.pool.layer(i)
            k_scale, v_scale = self.pool.scales(i)
            return rope_store(q, k, v, step.positions, cos_sin_cache, k_cache, v_cache, step.slot_mapping,
                              k_scale=k_scale, v_scale=v_scale)
        slots = torch.where(step.slot_mapping >= 0, step.extras["deltakv_raw_slots"], -1)
        k_cache, v_cache = self.raw.layer(i)
        k_scale, v_scale = self.raw.scales(i)
        return rope_store(q, k, v, step.positions, cos_sin_cache, k_cache, v_cache, slots, k_scale=k_scale,
                          v_scale=v_scale)

    def prefill_view(self, layer_id: int, step: StepState) -> PrefillView:
        i = self.index[layer_id]
        if self.roles[layer_id][0] == "filter":
            k_cache, v_cache = self.pool.layer(i)
            return PrefillView(k_cache, v_cache, step.block_tables, step.cache_lens, self.page_size,
                               *self.pool.scales(i))
        k_cache, v_cache = self.raw.layer(i)
        k_scale, v_scale = self.raw.scales(i)
        if "deltakv.prefix" not in step.scratch:   # nothing compressed yet: the raw slots are the prefix
            return PrefillView(k_cache, v_cache, step.extras["deltakv_raw_tables"], step.cache_lens, 1, k_scale,
                               v_scale)
        lens, offsets, table = step.scratch["deltakv.prefix"]
        out_k, out_v = self._rebuild(i, step, range(len(lens)), lens, offsets)
        return PrefillView(out_k, out_v, table, step.cache_lens, 1)

    def _rebuild(self, i: int, step: StepState, batch_rows, lens: list[int], offsets: list[int]):
        """Sparse layer i's first lens[j] tokens of request batch_rows[j], raw ones copied and
        compressed ones rebuilt (up(z) + references, RoPE at their positions), at offsets[j] of
        one new [sum(lens), H, D] K and V (the model dtype: FP8 raw slots are dequantized as read)."""
        k_cache, v_cache = self.raw.layer(i)
        k_scale, v_scale = self.raw.scales(i)
        out_k = torch.empty(sum(lens), self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
        out_v = torch.empty_like(out_k)
        P, codec = self.page_size, self.codecs[i]
        rows = step.extras["deltakv_rows"]
        for b, length, off in zip(batch_rows, lens, offsets):
            for a in range(0, length, PREFIX_PIECE):
                m = min(PREFIX_PIECE, length - a)
                pos = self.positions[0, a:a + m].long()
                latent_slots = step.block_tables[b].long()[pos // P] * P + pos % P
                up_z = up_of(codec.up, self.latents[i], latent_slots).view(1, m, -1)
                reconstruct(pos.view(1, m).to(torch.int32), torch.full((1,), m, dtype=torch.int32, device=self.device),
                            rows[b:b + 1], self.raw_map, k_cache, v_cache, up_z.contiguous(), self.neighbors[i],
                            latent_slots.view(1, m), 0, self.cos_sin, out_k[off + a:off + a + m],
                            out_v[off + a:off + a + m], k_scale, v_scale)
        return out_k, out_v

    def recall_view(self, layer_id: int, step: StepState) -> DecodeView | None:
        """A sparse layer: every token of each sampled request as its prefill would attend them
        (compressed ones rebuilt), in a buffer made for this step; other rows have length 0."""
        if self.roles[layer_id][0] != "sparse":
            return None
        rows = step.recall.rows
        lens = [step.seqs[b].cache_len + 1 for b in rows]   # + this decode step's token
        offsets = np.cumsum([0] + lens[:-1]).tolist()
        out_k, out_v = self._rebuild(self.index[layer_id], step, rows, lens, offsets)
        B, width = step.batch_size, max(lens)
        table = np.zeros((B, 1, width), dtype=np.int32)
        lengths = np.zeros((B, 1), dtype=np.int32)
        for b, length, off in zip(rows, lens, offsets):
            table[b, 0, :length] = np.arange(off, off + length)
            lengths[b, 0] = length
        return DecodeView(out_k, out_v, to_device(table, self.device, torch.int32),
                          to_device(lengths, self.device, torch.int32), 1)

    def build_decode_view(self, layer_id: int, q: torch.Tensor, step: StepState) -> DecodeView:
        role, source = self.roles[layer_id]
        if role == "filter":
            k_cache, v_cache = self.pool.layer(self.index[layer_id])
            k_scale, v_scale = self.pool.scales(self.index[layer_id])
            view = DecodeView(k_cache, v_cache, step.block_tables.unsqueeze(1), step.cache_lens.unsqueeze(1),
                              self.page_size, k_scale=k_scale, v_scale=v_scale)
            if layer_id + 1 < self.num_layers and self.roles[layer_id + 1][0] == "sparse":
                return scored_view(view, step, f"deltakv.{layer_id}")   # it scores the tokens of the run after it
            return view
        # the first sparse layer of the run selects for the run, from the per-group maxima [B, H_kv, T]
        view_pos, lengths, latent_slots = selection(step, f"deltakv.{source}",
                                                    lambda scores: self._select(scores.amax(dim=1), step))
        i = self.index[layer_id]
        B = view_pos.shape[0]
        up_z = up_of(self.codecs[i].up, self.latents[i], latent_slots)              # [B, keep, 2 H D]
        k_cache, v_cache = self.raw.layer(i)
        # the kernel reads each token's references through its latent slot (no gather launch)
        reconstruct(view_pos, lengths, step.extras["deltakv_rows"], self.raw_map, k_cache, v_cache, up_z.contiguous(),
                    self.neighbors[i], latent_slots, self.method_config.deltakv_sink, self.cos_sin, self.scratch_k,
                    self.scratch_v, *self.raw.scales(i))
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
