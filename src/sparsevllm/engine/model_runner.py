"""Device, model, KV pool sizing, the forward of one step and sampling. No method branches here:
methods act only through the cache manager's hooks."""
import gc
import logging

import torch
import torch.distributed as dist

from sparsevllm import distributed as tp
from sparsevllm.config import EngineConfig
from sparsevllm.engine.step import StepState
from sparsevllm.engine.sparse_controller import SparseController
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


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, model_config: ModelConfig, method_cls):
        self.config, self.model_config = config, model_config
        self.device = resolve_device(config.device)
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
        model_cfg = model_config
        self.num_kv_heads = model_cfg.num_key_value_heads // tp.tp_size()   # this rank's KV heads
        # Every rank holds the same pages (rank 0 allocates them for all): the fewest any rank fits.
        num_pages = tp.agree_min(self._num_kv_pages(method_cls))
        self.cache_manager = method_cls(config, model_cfg.num_hidden_layers, self.num_kv_heads,
                                        model_cfg.head_dim, num_pages, self.dtype, self.device)
        self.controller = SparseController(self.cache_manager)
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            if method_cls.capabilities.cuda_graph:
                self.graphs = DecodeGraphs(self)
            else:
                logger.warning("method %s cannot be captured in CUDA graphs: decode runs eagerly",
                               config.vllm_sparse_method)
        self.execution_mode = "cuda_graph" if self.graphs is not None else "eager"
        logger.info("model %s on %s (%s), KV pool %d pages of %d tokens", model_cfg.architecture, self.device,
                    self.dtype, num_pages, config.page_size)

    def _num_kv_pages(self, method_cls) -> int:
        cfg, model_cfg = self.config, self.model_config
        page_bytes = method_cls.bytes_per_page(cfg, model_cfg.num_hidden_layers, self.num_kv_heads,
                                               model_cfg.head_dim, self.dtype)
        if cfg.num_kv_pages is not None:
            return cfg.num_kv_pages
        # Never more than every running request at full length could use.
        useful = cfg.max_num_seqs * (-(-cfg.max_model_len // cfg.page_size))
        if self.device.type == "cpu":
            return max(1, min(useful, int(cfg.cpu_kv_cache_gb * GiB) // page_bytes))
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        activations = self._activation_bytes()
        budget = total * cfg.gpu_memory_utilization - used_by_others - torch.cuda.memory_allocated(self.device) \
            - activations - method_cls.fixed_device_bytes(cfg, model_cfg.num_hidden_layers,
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
        if self.graphs is not None and not step.is_prefill and step.batch_size <= self.graphs.max_bs:
            logits = self.graphs.replay(step)
            return logits.float() if logits is not None else None
        return self.eager_forward(step)

    def eager_forward(self, step: StepState) -> torch.Tensor | None:
        self.controller.begin(step)
        try:
            hidden = self.model(step.input_ids, step.positions)
            logits = self.model.compute_logits(hidden[step.logits_indices])
        finally:
            self.controller.end()
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
        self.graphs, self.outputs = {}, {}
        self.pool = None
        for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory pool
            self._capture(b)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _view(self, b: int) -> StepState:
        s = self.static
        return StepState(is_prefill=False, seqs=[None] * b, num_tokens=[1] * b, sampled=list(range(b)),
                         input_ids=s.input_ids[:b], positions=s.positions[:b], slot_mapping=s.slot_mapping[:b],
                         block_tables=s.block_tables[:b], cache_lens=s.cache_lens[:b],
                         cu_seqlens_q=s.cu_seqlens_q[:b + 1], logits_indices=s.logits_indices[:b],
                         extras={k: v[:b] for k, v in s.extras.items()})

    @torch.inference_mode()
    def _capture(self, b: int) -> None:
        step = self._view(b)
        self.runner.eager_forward(step)  # warm-up: compiles kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        self.runner.controller.begin(step)
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = self.runner.model(step.input_ids, step.positions)
                self.outputs[b] = self.runner.model.compute_logits(hidden[step.logits_indices], gather=False)
        finally:
            self.runner.controller.end()
        self.pool = self.pool or graph.pool()
        self.graphs[b] = graph

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
        self.graphs[b].replay()
        return self.runner.model.gather_logits(self.outputs[b][:n])
