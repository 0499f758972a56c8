"""The memory-bandwidth roofline of a decode step, and what each method reads and stores.

A decode step reads every weight once plus the KV it attends to (BENCHMARKS.md):
    step_time >= (weight_bytes + sum over requests of kv_bytes_read) / hbm_bandwidth
    tokens/s = batch / step_time
`kv_tokens_read` and `kv_tokens_stored` are the per-method hooks: a method adds its entry to
KV_TOKENS_READ / KV_TOKENS_STORED (KV tokens one decode step of one request reads, averaged over
layers and counting metadata in token-sized units; device KV tokens one request holds at its peak).
A method without an entry is treated as dense, and the row says so. `knobs` is the method's resolved
configuration, flat: engine knobs and method knobs with their defaults filled in.
"""
from typing import Callable

# device-to-device copy rate measured on the H200 (BENCHMARKS.md)
DEFAULT_HBM_BW = 4.23e12


def _dense_read(knobs: dict, cfg: dict, prompt_len: int, context_len: int) -> float:
    return context_len


def _quest_read(knobs: dict, cfg: dict, prompt_len: int, context_len: int) -> float:
    """Quest: the first quest_skip_layers layers read everything; the others read the page bounds
    (a min and a max key per page: context/P token-equivalents of K+V) plus the budget."""
    layers, skip = cfg["num_hidden_layers"], min(knobs["quest_skip_layers"], cfg["num_hidden_layers"])
    sparse = min(knobs["quest_token_budget"], context_len) + context_len / knobs["page_size"]
    return (skip * context_len + (layers - skip) * sparse) / layers


def _snapkv_read(knobs: dict, cfg: dict, prompt_len: int, context_len: int) -> float:
    """SnapKV: after prefill a request keeps snapkv_capacity prompt tokens; decode tokens append."""
    return min(prompt_len, knobs["snapkv_capacity"]) + (context_len - prompt_len)


def _dense_stored(knobs: dict, length: int, output_len: int) -> int:
    return length + output_len


# method -> f(knobs, model config, prompt_len, context_len) -> KV tokens one decode step of one request reads
KV_TOKENS_READ: dict[str, Callable[[dict, dict, int, int], float]] = {
    "vanilla": _dense_read, "hf": _dense_read, "quest": _quest_read, "snapkv": _snapkv_read}
# method -> f(knobs, prompt length, output_len) -> device KV tokens one request holds at its peak.
# SnapKV has none: its peak depends on when eviction runs relative to the other requests' prefill.
KV_TOKENS_STORED: dict[str, Callable[[dict, int, int], int]] = {"vanilla": _dense_stored, "quest": _dense_stored}


def kv_tokens_read(method: str, knobs: dict, cfg: dict, prompt_len: int, context_len: int) -> float:
    return KV_TOKENS_READ.get(method, _dense_read)(knobs, cfg, prompt_len, context_len)


def kv_tokens_stored(method: str, knobs: dict, length: int, output_len: int) -> int | None:
    """None when the method has no entry: its peak footprint is unknown, so no fit check is made."""
    fn = KV_TOKENS_STORED.get(method)
    return None if fn is None else fn(knobs, length, output_len)


def roofline_model(method: str) -> str:
    return method if method in KV_TOKENS_READ else "dense (method has no kv_tokens_read entry)"


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def weight_bytes(cfg: dict, dtype_bytes: int) -> int:
    """Bytes of every linear layer plus lm_head: what one decode step must stream from memory.
    Embedding rows are gathered, not streamed, so the embedding table is left out; norms are noise."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * _head_dim(cfg)
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * _head_dim(cfg)
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    if cfg.get("attention_bias") or cfg.get("model_type") == "qwen2":
        per_layer += q + 2 * kv
    params = cfg["num_hidden_layers"] * per_layer + h * cfg["vocab_size"]
    return params * dtype_bytes


def kv_bytes_per_token(cfg: dict, dtype_bytes: int) -> int:
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return 2 * cfg["num_hidden_layers"] * kv_heads * _head_dim(cfg) * dtype_bytes


def roofline(cfg: dict, dtype_bytes: int, method: str, knobs: dict, batch: int, length: int,
             output_len: int, hbm_bw: float = DEFAULT_HBM_BW) -> dict:
    """Decode tok/s at the bandwidth limit, averaged over the steps of the generation: the step that
    produces token i attends to length + i tokens."""
    w = weight_bytes(cfg, dtype_bytes)
    per_tok = kv_bytes_per_token(cfg, dtype_bytes)
    steps = [(w + batch * per_tok * kv_tokens_read(method, knobs, cfg, length, length + i)) / hbm_bw
             for i in range(max(output_len, 1))]
    step_time = sum(steps) / len(steps)
    return {"roofline_tok_s": batch / step_time, "roofline_step_ms": step_time * 1e3,
            "weight_bytes": w, "kv_bytes_per_token": per_tok, "hbm_bw": hbm_bw,
            "roofline_kv_model": roofline_model(method)}
