import functools
import os

import pytest
import torch

# Triton's interpreter is chosen when kernels are decorated, so it must be on before anything imports
# them; without CUDA it is the only way Triton kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every Triton kernel launched under the interpreter in this session, by signature: the interpreter
# runs kernels the GPU compiler rejects (a name bound to tensors of two shapes in an if/else, say),
# so tests/test_zz_triton_compiles.py compiles each recorded launch for the H200 at the end.
TRITON_LAUNCHES: dict = {}
_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                 torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                 torch.bool: "i1"}


@functools.cache
def _jit(fn):
    import triton
    return triton.JITFunction(fn)   # parsed once a kernel, not once a launch


def _launch(kernel, args, kwargs):
    """(key, launch): the kernel's module and name, its argument types, constexprs and options, as
    plain values (tests/test_zz_triton_compiles.py compiles them in a fresh process)."""
    jit = _jit(kernel.fn)
    bound = dict(zip(jit.arg_names, args)) | {k: v for k, v in kwargs.items() if k in jit.arg_names}
    signature, constexprs = {}, {}
    for i, (name, param) in enumerate(zip(jit.arg_names, jit.params)):
        value = bound.get(name, param.default)
        if i in jit.constexprs or value is None:
            signature[name] = "constexpr"
            constexprs[name] = value if isinstance(value, (int, float, str, type(None))) else repr(value)
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
        else:
            signature[name] = "fp32"
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    launch = dict(module=kernel.fn.__module__, name=kernel.fn.__qualname__, signature=signature,
                  constexprs=constexprs, options=options)
    return repr(sorted(launch.items())), launch


def _record_triton_launches():
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        key, launch = _launch(self, args, kwargs)
        TRITON_LAUNCHES.setdefault(key, launch)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


if os.environ.get("TRITON_INTERPRET") == "1":
    _record_triton_launches()

ARCHS = {
    "llama": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=False)),
    "llama_tied": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=True)),
    "qwen2": dict(cls="Qwen2Config", extra=dict(tie_word_embeddings=False)),
    "qwen3": dict(cls="Qwen3Config", extra=dict(tie_word_embeddings=False, head_dim=16)),
    "mistral": dict(cls="MistralConfig", extra=dict(tie_word_embeddings=False, sliding_window=None)),
}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def make_tiny_model(path, arch: str = "llama", seed: int = 0, max_shard_size=None, **overrides):
    """A tiny random Hugging Face model saved as safetensors. A large initializer_range keeps the
    logits far from ties, so greedy decoding is a sharp test of numerical equality."""
    import transformers
    spec = ARCHS[arch]
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    kw.update(spec["extra"])
    kw.update(overrides)
    config = getattr(transformers, spec["cls"])(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF initialises biases (Qwen2's, attention_bias=True) to zero; make them matter
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.2)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return str(path)


@pytest.fixture(scope="session")
def preset_model():
    """preset_model(name) -> the ModelConfig of a benchmark preset (src/sparsevllm/presets/<name>.json)."""
    import json
    from importlib import resources

    from sparsevllm.models.config import ModelConfig

    def load(name):
        text = resources.files("sparsevllm.presets").joinpath(f"{name}.json").read_text()
        return ModelConfig.from_dict(json.loads(text))
    return load


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch="llama", **config_overrides) -> path of a saved tiny random HF model."""
    cache = {}

    def build(arch="llama", **overrides):
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(tmp_path_factory.mktemp(arch), arch, **overrides)
        return cache[key]
    return build
