"""Uniform budget accounting: what one request of a cell reads each decode step and holds, in the
same units for every method, from the method's own classmethods (the benchmark's roofline uses the
same ones). A budget knob is not comparable across methods on its face: OmniKV's filter layers and
DeltaKV's full layers read the whole cache whatever the budget, QuEST reads its page bounds too,
and SnapKV's capacity is what it keeps rather than what it reads."""


def kv_bytes_per_token(model_config, dtype_bytes: int) -> int:
    """K and V of one token over every layer (model_config: a ModelConfig)."""
    m = model_config
    return 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * dtype_bytes


def budget_accounting(method: str, knobs: dict, model_config: dict, prompt_len: int, output_len: int,
                      dtype_bytes: int) -> dict:
    """KV tokens and bytes one request reads per decode step (averaged over its output_len steps,
    as the benchmark's roofline) and holds at its peak (None where the method cannot say ahead:
    SnapKV's peak depends on when its eviction runs; the report then shows the measured one)."""
    from sparsevllm.method_registry import make_config
    from sparsevllm.models.config import ModelConfig

    config = make_config(None, method, **knobs)
    mc = ModelConfig.from_dict(model_config)
    cls = config.method
    cls.validate_model(config, mc)   # resolves what the model decides (DeltaKV's latent dim from its compressor)
    steps = max(output_len, 1)
    read = sum(cls.decode_kv_tokens_read(config, mc, prompt_len, prompt_len + i) for i in range(steps)) / steps
    held = cls.kv_tokens_held(config, mc, prompt_len, output_len)
    per_token = kv_bytes_per_token(mc, dtype_bytes)
    return {"kv_tokens_read": read, "kv_bytes_read": read * per_token,
            "kv_tokens_held": held, "kv_bytes_held": None if held is None else held * per_token,
            "kv_bytes_per_token": per_token, "prompt_len": prompt_len, "output_len": output_len}


def dtype_bytes(name: str | None, on_gpu: bool) -> int:
    """A dtype's width; "auto" or unknown is the engine's default (bf16 on a GPU, fp32 on a CPU)."""
    widths = {"float32": 4, "bfloat16": 2, "float16": 2}
    if name in widths:
        return widths[name]
    return 2 if on_gpu else 4
