"""Device, model, KV pool sizing, the step's inputs, the forward of one step and its CUDA graphs.
No method branches here: methods act only through the cache manager's hooks."""
import gc
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from sparsevllm import distributed as tp
from sparsevllm.config import EngineConfig
from sparsevllm.engine.cache_manager.base import CacheManager
from sparsevllm.engine.recall import RecallSample
from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.staging import HostStaging
from sparsevllm.engine.step import StepState
from sparsevllm.layers.attention import Attention
from sparsevllm.models.config import ModelConfig
from sparsevllm.models.loader import init_dummy_weights, load_weights
from sparsevllm.models.registry import get_model_class

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GiB = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use device='cpu' or 'auto'")
    if name == "cuda" and tp.tp_size() > 1:
        return torch.device("cuda", tp.tp_rank())   # one GPU per rank
    return torch.device(name)


def busy_cores(cores: list[int], interval: float = 0.1) -> float | None:
    """How many of these CPUs other work keeps busy, measured over `interval` seconds from
    /proc/stat while this process sleeps; None where that cannot be read (not Linux)."""
    def sample():
        try:
            with open("/proc/stat") as f:
                rows = {r.split()[0]: [int(x) for x in r.split()[1:9]] for r in f if r.startswith("cpu")}
            return [(sum(rows[f"cpu{c}"]), rows[f"cpu{c}"][3] + rows[f"cpu{c}"][4]) for c in cores]
        except (OSError, KeyError, ValueError, IndexError):
            return None
    before = sample()
    time.sleep(interval)
    after = sample()
    if before is None or after is None:
        return None
    return sum(1 - (i1 - i0) / max(t1 - t0, 1) for (t0, i0), (t1, i1) in zip(before, after))


# What torch had before an engine of this process first set its threads, and what it set last: a
# later engine (the regression harness and the report start one per variant) starts again from
# torch's count, not from an earlier engine's choice made under another load.
_threads_before_engines: int | None = None
_threads_set: int | None = None


def cpu_threads() -> tuple[int, str]:
    """Intra-op threads for a CPU engine, and why. OMP_NUM_THREADS where it is set; else the cores
    of this process's affinity that other work leaves free (at least one), and never more than
    torch has (a caller's torch.set_num_threads stands; an earlier engine's does not). Torch's
    default, every core, collapses where other jobs hold some: its threads wait for each other at
    every operator (an 8-token reply of the default model took 11.8-14.6 s on a busy 2-core machine,
    1.5 s with one thread; see docs/performance.md)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), "OMP_NUM_THREADS"
    have = torch.get_num_threads()
    if _threads_set is not None and have == _threads_set:
        have = _threads_before_engines   # our own earlier setting, not the caller's
    if have == 1:
        return 1, "torch has one"   # nothing to lower: skip the 0.1 s measurement
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    busy = busy_cores(cores)
    if busy is None:
        return have, "torch's default"
    free = max(1, round(len(cores) - busy))
    return min(free, have), f"{busy:.1f} of {len(cores)} cores busy"


def set_cpu_threads(n: int) -> None:
    global _threads_before_engines, _threads_set
    if _threads_before_engines is None:
        _threads_before_engines = torch.get_num_threads()
    torch.set_num_threads(n)
    _threads_set = n


def make_cache_manager(config: EngineConfig, model_config: ModelConfig, runner: "ModelRunner") -> CacheManager:
    """The one place a rank's cache manager is built: the method's class (config.method) over the KV
    pages this rank's memory holds beside its weights, then bound to the runner's attention layers."""
    num_pages = tp.agree_min(runner.num_kv_pages(config.method))   # every rank holds the same pages
    cm = config.method(config, model_config, runner.num_kv_heads, num_pages, runner.dtype, runner.device)
    runner.bind(cm)
    logger.info("model %s on %s (%s), KV pool %d pages of %d tokens", model_config.architecture, runner.device,
                runner.dtype, cm.num_pages, config.page_size)
    return cm


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, model_config: ModelConfig):
        self.config, self.model_config = config, model_config
        self.device = resolve_device(config.device)
        self.threads = None
        if self.device.type == "cpu":
            self.threads, why = cpu_threads()
            set_cpu_threads(self.threads)
            logger.info("%d CPU threads (%s)", self.threads, why)
        self.dtype = DTYPES[config.dtype] if config.dtype != "auto" else (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        model_cls = get_model_class(model_config.architecture)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_cls(model_config)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, model_path)
        self.model.eval()
        self.num_kv_heads = model_config.num_key_value_heads // tp.tp_size()   # this rank's KV heads
        self.staging = HostStaging(self.device)
        self.cache_manager: CacheManager | None = None
        self.graphs = None
        self.execution_mode = "eager"

    def bind(self, cache_manager: CacheManager) -> None:
        """Hand every attention layer the cache manager, then capture the decode graphs over its hooks."""
        self.cache_manager = cache_manager
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.cache_manager = cache_manager
        if self.device.type == "cuda" and not self.config.enforce_eager:
            if cache_manager.capabilities.cuda_graph:
                self.graphs = DecodeGraphs(self)
            else:
                logger.warning("method %s cannot be captured in CUDA graphs: decode runs eagerly",
                               self.config.vllm_sparse_method)
        self.execution_mode = "cuda_graph" if self.graphs is not None else "eager"

    def num_kv_pages(self, method: type[CacheManager]) -> int:
        """KV pages of this rank: num_kv_pages if set, else what the memory left after the weights
        and the activations holds (cpu_kv_cache_gb on a CPU), and never more than every running
        request at full length could use."""
        cfg, model_cfg = self.config, self.model_config
        page_bytes = method.bytes_per_page(cfg, model_cfg.num_hidden_layers, self.num_kv_heads,
                                           model_cfg.head_dim, self.dtype)
        if cfg.num_kv_pages is not None:
            return cfg.num_kv_pages
        useful = cfg.max_num_seqs * (-(-cfg.max_model_len // cfg.page_size))
        if self.device.type == "cpu":
            return max(1, min(useful, int(cfg.cpu_kv_cache_gb * GiB) // page_bytes))
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        activations = self._activation_bytes()
        budget = total * cfg.gpu_memory_utilization - used_by_others - torch.cuda.memory_allocated(self.device) \
            - activations - method.fixed_device_bytes(cfg, model_cfg.num_hidden_layers,
                                                      model_cfg.num_key_value_heads, model_cfg.head_dim, self.dtype)
        pages = int(budget // page_bytes)
        if pages < 1:
            raise ValueError(f"no GPU memory left for the KV cache (gpu_memory_utilization="
                             f"{cfg.gpu_memory_utilization}, weights {torch.cuda.memory_allocated() / GiB:.1f} GiB)")
        return min(useful, pages)

    def _activation_bytes(self) -> int:
        """Peak transient memory of the largest prefill step, estimated from the model shape: the
        hidden states, the qkv and gate/up projections of max_num_batched_tokens tokens, and the
        logits of one row per sequence, with a 2x margin for allocator slack."""
        m, cfg = self.model_config, self.config
        t = cfg.max_num_batched_tokens
        width = m.hidden_size * 4 + (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim \
            + 3 * m.intermediate_size
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * (t * width * elem + cfg.max_num_seqs * m.vocab_size * 4)

    def release_graphs(self) -> None:
        """Drop the decode graphs (the runner then decodes eagerly). Called before a tensor-parallel
        teardown: NCCL's teardown hangs while graphs that captured its all-reduces are alive
        (pytorch/pytorch#115388; it hung on the H200s until this ran first)."""
        if self.graphs is not None:
            self.graphs = None
            self.execution_mode = "eager"
            gc.collect()   # no device sync: after a failed rank a captured all-reduce may never finish

    def prepare_step(self, seqs: list[Sequence], num_tokens: list[int], is_prefill: bool,
                     feed_rows: list[int] | None = None) -> StepState:
        """Build the step's inputs from the requests' counters and the cache manager's block tables,
        then let the method add its own (`on_step_begin`). The last token of a request that has all
        its known tokens computed after this step is sampled. feed_rows[i] >= 0 names the row of the
        previous step's sampled tokens that holds request i's input token (overlapped decode)."""
        cm = self.cache_manager
        P, B, T = cm.page_size, len(seqs), sum(num_tokens)
        width = max(len(cm.tables[s.seq_id]) for s in seqs)
        sampled = [i for i, (s, n) in enumerate(zip(seqs, num_tokens)) if s.num_computed_tokens + n == len(s)]
        # Prompt positions whose logits a request wants (prompt_logprobs): each predicts the next
        # prompt token, so the last prompt position (it predicts the first output) is not one.
        prompt_rows = [(i, s.num_computed_tokens, min(n, s.num_prompt_tokens - 1 - s.num_computed_tokens))
                       for i, (s, n) in enumerate(zip(seqs, num_tokens))
                       if s.params.prompt_logprobs is not None and s.num_computed_tokens < s.num_prompt_tokens - 1]
        S = sum(count for _, _, count in prompt_rows) + len(sampled)
        F = B if feed_rows is not None else 0
        # Every integer input of the step goes into one (pinned) host buffer and crosses to the
        # device in one copy, already in the dtypes the kernels take: per-tensor copies and casts
        # cost more than the decode step's own host work at small batch.
        n64, n32 = 3 * T + S + F, B * width + 2 * B + 1       # int64: ids, pos, slots, logits rows, feed
        raw = self.staging.host(8 * n64 + 4 * n32)
        i64, i32 = raw[:8 * n64].view(np.int64), raw[8 * n64:].view(np.int32)
        ids, pos, slots = i64[:T], i64[T:2 * T], i64[2 * T:3 * T]
        lens, cu, tables = i32[:B], i32[B:2 * B + 1], i32[2 * B + 1:].reshape(B, width)
        cu[0], off = 0, 0
        for i, (seq, n) in enumerate(zip(seqs, num_tokens)):
            start = seq.num_computed_tokens
            known = seq.token_ids[start:start + n]
            ids[off:off + len(known)] = known
            ids[off + len(known):off + n] = 0   # still on the device: fed from feed_rows
            pos[off:off + n] = np.arange(start, start + n)
            stored = np.arange(seq.cache_len, seq.cache_len + n)
            arr = cm.tables.arrays[seq.seq_id]
            slots[off:off + n] = arr[stored // P].astype(np.int64) * P + stored % P
            tables[i] = arr[:width]
            lens[i] = seq.cache_len + n
            off += n
            cu[i + 1] = off
        rows = cu[1:][sampled] - 1
        if prompt_rows:
            rows = np.concatenate([np.arange(cu[i], cu[i] + count) for i, _, count in prompt_rows] + [rows])
        i64[3 * T:3 * T + S] = rows
        if F:
            i64[3 * T + S:] = feed_rows
        has_prefix = bool((lens != np.asarray(num_tokens)).any())
        dev = self.staging.upload(raw)
        d64, d32 = dev[:8 * n64].view(torch.int64), dev[8 * n64:].view(torch.int32)
        step = StepState(
            is_prefill=is_prefill, seqs=seqs, num_tokens=list(num_tokens), sampled=sampled,
            input_ids=d64[:T], positions=d64[T:2 * T], slot_mapping=d64[2 * T:3 * T],
            block_tables=d32[2 * B + 1:].view(B, width), cache_lens=d32[:B], cu_seqlens_q=d32[B:2 * B + 1],
            max_seqlen_q=max(num_tokens), has_prefix=has_prefix, logits_indices=d64[3 * T:3 * T + S],
            prompt_logprob_rows=prompt_rows,
            feed_rows=d64[3 * T + S:] if F else None)
        every = self.config.recall_sample_every
        if every:   # decode: the rows at their every-th decode step; prefill: for a method measuring then
            rows = [] if is_prefill else [i for i, s in enumerate(seqs)
                                          if (s.num_computed_tokens - s.num_prompt_tokens) % every == 0]
            if is_prefill or rows:
                step.recall = RecallSample(rows, B, self.model_config.num_hidden_layers, self.device)
        cm.on_step_begin(step)
        if not is_prefill:
            step.graph_variant = cm.graph_variant(step)
        return step

    @torch.inference_mode()
    def forward(self, step: StepState, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run the model on a step; return fp32 logits of the rows in step.logits_indices (None on
        a tensor-parallel rank > 0). prev_tokens: the previous step's sampled tokens, where
        step.feed_rows takes input ids from."""
        if step.feed_rows is not None:
            fed = prev_tokens[step.feed_rows.clamp(min=0)]
            step.input_ids = torch.where(step.feed_rows >= 0, fed, step.input_ids)
            if tp.tp_size() > 1:
                dist.broadcast(step.input_ids, src=0)   # the other ranks have no sampled tokens
        # A step measuring attention recall runs eagerly: the graphs hold no measurement.
        if self.graphs is not None and not step.is_prefill and step.recall is None \
                and step.batch_size <= self.graphs.max_bs:
            logits = self.graphs.replay(step)
            return logits.float() if logits is not None else None
        return self.eager_forward(step)

    def eager_forward(self, step: StepState) -> torch.Tensor | None:
        hidden = self.model(step)
        logits = self.model.compute_logits(hidden[step.logits_indices])
        return logits.float() if logits is not None else None


class DecodeGraphs:
    """One CUDA graph of the whole decode forward per batch-size bucket (1, 2, 4, 8, 16, 32, ...).

    Graphs read fixed tensors, so every step's inputs are copied into static buffers sized for the
    largest bucket; rows past the real batch are padding (slot -1 writes nowhere, length 1 reads one
    harmless token, and their logits are dropped). The block-table width is fixed at max_model_len
    pages, so the decode kernel's split count is fixed per bucket; kernels size their work from
    the lengths they read, not from the table width.

    Under tensor parallelism each rank captures the same buckets in the same order; a graph holds
    the rank's NCCL all-reduces (two per layer, plus the embedding's), and the LM head's gather
    to rank 0 runs after the replay, on the rows of the real batch.
    """

    def __init__(self, runner: ModelRunner):
        cfg, cm = runner.config, runner.cache_manager
        self.runner = runner
        self.max_bs = cfg.max_num_seqs
        self.buckets = sorted({min(1 << i, self.max_bs) for i in range(self.max_bs.bit_length() + 1)})
        max_pages = cm.pages_for(cfg.max_model_len)
        dev, bs = runner.device, self.max_bs
        self.static = StepState(
            is_prefill=False, seqs=[], num_tokens=[], sampled=[],
            input_ids=torch.zeros(bs, dtype=torch.int64, device=dev),
            positions=torch.zeros(bs, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((bs,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(bs, max_pages, dtype=torch.int32, device=dev),
            cache_lens=torch.ones(bs, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.arange(bs + 1, dtype=torch.int32, device=dev),
            logits_indices=torch.arange(bs, dtype=torch.int64, device=dev),
            extras=cm.graph_extras(bs))
        self.graphs, self.outputs = {}, {}   # keyed (bucket, variant)
        self.pool = None
        variants = cm.graph_variants()
        # A collection during a capture can free an earlier engine's graphs (an engine's parts form
        # cycles, so only the collector frees them), and destroying a graph is not allowed while a
        # stream captures: it invalidated this capture on the GPU (H100, 2026-12-08, the mixed-methods
        # test building one LLM after another). torch 2.11 no longer collects on entering a capture,
        # so collect here, once, and keep the collector off until the buckets are captured.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory pool
                for variant in variants:
                    self._capture(b, variant)
        finally:
            if collecting:
                gc.enable()
        logger.info("captured decode CUDA graphs for batch sizes %s%s", self.buckets,
                    f", variants {variants}" if len(variants) > 1 else "")

    def _view(self, b: int, variant: str) -> StepState:
        s = self.static
        return StepState(is_prefill=False, seqs=[None] * b, num_tokens=[1] * b, sampled=list(range(b)),
                         input_ids=s.input_ids[:b], positions=s.positions[:b], slot_mapping=s.slot_mapping[:b],
                         block_tables=s.block_tables[:b], cache_lens=s.cache_lens[:b],
                         cu_seqlens_q=s.cu_seqlens_q[:b + 1], logits_indices=s.logits_indices[:b],
                         extras={k: v[:b] for k, v in s.extras.items()}, graph_variant=variant)

    @torch.inference_mode()
    def _capture(self, b: int, variant: str) -> None:
        step = self._view(b, variant)
        self.runner.eager_forward(step)  # warm-up: compiles kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        step = self._view(b, variant)   # a fresh step: what the warm-up's hooks left in step.scratch is not captured
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.runner.model(step)
            self.outputs[b, variant] = self.runner.model.compute_logits(hidden[step.logits_indices], gather=False)
        self.pool = self.pool or graph.pool()
        self.graphs[b, variant] = graph

    def replay(self, step: StepState) -> torch.Tensor:
        n = step.batch_size
        b = next(x for x in self.buckets if x >= n)
        s = self.static
        s.input_ids[:n].copy_(step.input_ids)
        s.positions[:n].copy_(step.positions)
        s.slot_mapping[:n].copy_(step.slot_mapping)
        s.slot_mapping[n:b].fill_(-1)
        width = step.block_tables.shape[1]
        s.block_tables[:n, :width].copy_(step.block_tables)
        s.cache_lens[:n].copy_(step.cache_lens)
        s.cache_lens[n:b].fill_(1)
        for k, v in step.extras.items():
            s.extras[k][:n].copy_(v)
        key = (b, step.graph_variant)
        self.graphs[key].replay()
        return self.runner.model.gather_logits(self.outputs[key][:n])
