"""The memory-bandwidth roofline of a decode step.

A decode step reads every weight once plus the KV it attends to (BENCHMARKS.md):
    step_time >= (weight_bytes + sum over requests of kv_bytes_read) / hbm_bandwidth
    tokens/s = batch / step_time
What one request's decode step reads is the method's own answer: its cache manager's classmethod
`decode_kv_tokens_read(config, model_config, prompt_len, cache_len)` (KV tokens averaged over layers,
metadata in token-sized units), so adding a method never edits this file. `kv_read` is that function
with the method and its resolved config bound, or None for a dense reader (the HF baseline).
"""
import time
from typing import Callable

from sparsevllm.models.config import config_architecture

# device-to-device copy rate measured on the H200 (BENCHMARKS.md)
DEFAULT_HBM_BW = 4.23e12
# A CPU's copy is timed on 256 MiB, far past its caches, so it measures DRAM like a model's weights do.
CPU_COPY_BYTES = 256 << 20
CPU_COPY_HOW = "a 256 MiB tensor copy, bytes read + written, best of 3"


def measure_cpu_copy_bw() -> float:
    """This machine's memory bandwidth in bytes/s for a roofline on the CPU (CPU_COPY_HOW)."""
    import torch
    src = torch.ones(CPU_COPY_BYTES // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def weight_bytes(cfg: dict, dtype_bytes: int) -> int:
    """Bytes of every linear layer plus lm_head: what one decode step must stream from memory.
    Embedding rows are gathered, not streamed, so the embedding table is left out; norms are noise."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * _head_dim(cfg)
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * _head_dim(cfg)
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    if cfg.get("attention_bias") or config_architecture(cfg) == "Qwen2ForCausalLM":   # Qwen2: qkv bias always
        per_layer += q + 2 * kv
    params = cfg["num_hidden_layers"] * per_layer + h * cfg["vocab_size"]
    return params * dtype_bytes


def kv_bytes_per_token(cfg: dict, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """K + V bytes of one token over every layer as stored: the model dtype, or (kv_cache_dtype fp8)
    one byte an element plus an fp32 scale per KV head for K and for V (engine/kv_pool.py)."""
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    per_head = _head_dim(cfg) * dtype_bytes if kv_cache_dtype == "auto" else _head_dim(cfg) + 4
    return 2 * cfg["num_hidden_layers"] * kv_heads * per_head


def roofline(cfg: dict, dtype_bytes: int, kv_read: Callable[[int, int], float] | None, batch: int, length: int,
             output_len: int, hbm_bw: float = DEFAULT_HBM_BW, kv_cache_dtype: str = "auto") -> dict:
    """Decode tok/s at the bandwidth limit, averaged over the steps of the generation: the step that
    produces token i attends to length + i tokens. kv_read(prompt_len, cache_len) -> KV tokens one
    request's step reads; None reads the whole cache. With an FP8 cache a token costs its FP8 bytes
    and scales; metadata counted in token units (page bounds, kept in the model dtype) is then
    priced at that rate too, an undercount of at most the bounds' share (1/P of the context)."""
    read = kv_read or (lambda prompt_len, cache_len: cache_len)
    w = weight_bytes(cfg, dtype_bytes)
    per_tok = kv_bytes_per_token(cfg, dtype_bytes, kv_cache_dtype)
    steps = [(w + batch * per_tok * read(length, length + i)) / hbm_bw for i in range(max(output_len, 1))]
    step_time = sum(steps) / len(steps)
    return {"roofline_tok_s": batch / step_time, "roofline_step_ms": step_time * 1e3,
            "weight_bytes": w, "kv_bytes_per_token": per_tok, "hbm_bw": hbm_bw}
