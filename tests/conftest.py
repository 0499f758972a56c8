import os
import time

import pytest
import torch

import triton_compiles

# Triton's interpreter is chosen when kernels are decorated, so it must be on before anything imports
# them; without CUDA it is the only way Triton kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every Triton launch the interpreter runs is noted, and compiled for sm_90 after the tests
# (pytest_runtestloop below): the interpreter runs kernels the GPU compiler rejects.
if os.environ.get("TRITON_INTERPRET") == "1":
    triton_compiles.record_launches()

ARCHS = {
    "llama": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=False)),
    "llama_tied": dict(cls="LlamaConfig", extra=dict(tie_word_embeddings=True)),
    "qwen2": dict(cls="Qwen2Config", extra=dict(tie_word_embeddings=False)),
    "qwen3": dict(cls="Qwen3Config", extra=dict(tie_word_embeddings=False, head_dim=16)),
    "mistral": dict(cls="MistralConfig", extra=dict(tie_word_embeddings=False, sliding_window=None)),
}


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    """After the selected tests ran, the Triton launches they interpreted must compile for sm_90
    (tests/triton_compiles.py); the check is reported as one more test, so a failure fails the run
    whichever files were selected, and no test file has to run last."""
    result = yield
    if triton_compiles.LAUNCHES:
        start = time.perf_counter()
        failures = triton_compiles.compile_failures()
        path, name = triton_compiles.NODEID.split("::")
        session.testscollected += 1   # counted in the progress and the summary like the tests it follows
        session.config.hook.pytest_runtest_logreport(report=pytest.TestReport(
            triton_compiles.NODEID, (path, None, name), {}, "failed" if failures else "passed", failures, "call",
            duration=time.perf_counter() - start))
    return result


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
