"""Device, model, KV pool sizing, the forward of one step and sampling. No method branches here:
methods act only through the cache manager's hooks."""
import logging

import torch

from sparsevllm.config import EngineConfig
from sparsevllm.engine.cache_manager.base import StepState
from sparsevllm.engine.sparse_controller import SparseController
from sparsevllm.models.config import ModelConfig
from sparsevllm.models.loader import init_dummy_weights, load_weights
from sparsevllm.models.registry import get_model_class

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GiB = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use device='cpu' or 'auto'")
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
        mc = model_config
        num_pages = self._num_kv_pages(method_cls)
        self.cache_manager = method_cls(config, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                        num_pages, self.dtype, self.device)
        self.controller = SparseController(self.cache_manager)
        self.execution_mode = "eager"
        logger.info("model %s on %s (%s), KV pool %d pages of %d tokens", mc.architecture, self.device,
                    self.dtype, num_pages, config.page_size)

    def _num_kv_pages(self, method_cls) -> int:
        cfg, mc = self.config, self.model_config
        page_bytes = method_cls.bytes_per_page(cfg, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                               self.dtype)
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
            - activations
        pages = int(budget // page_bytes)
        if pages < 1:
            raise ValueError(f"no GPU memory left for the KV cache (gpu_memory_utilization="
                             f"{cfg.gpu_memory_utilization}, weights {torch.cuda.memory_allocated() / GiB:.1f} GiB)")
        return min(useful, pages)

    def _activation_bytes(self) -> int:
        """Peak transient memory of the largest prefill step, estimated from the model shape: the
        hidden states, the qkv and gate/up projections of max_num_batched_tokens tokens, and the
        logits of one row per sequence, with a 2x margin for allocator slack."""
        mc, cfg = self.model_config, self.config
        t = cfg.max_num_batched_tokens
        width = mc.hidden_size * 4 + (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim \
            + 3 * mc.intermediate_size
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * (t * width * elem + cfg.max_num_seqs * mc.vocab_size * 4)

    @torch.inference_mode()
    def forward(self, step: StepState) -> torch.Tensor:
        """Run the model on a step; return fp32 logits of the rows in step.logits_indices."""
        self.controller.begin(step)
        try:
            hidden = self.model(step.input_ids, step.positions)
            logits = self.model.compute_logits(hidden[step.logits_indices])
        finally:
            self.controller.end(step)
        return logits.float()
