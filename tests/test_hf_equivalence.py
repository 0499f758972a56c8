"""Vanilla greedy output equals Hugging Face transformers token-for-token (fp32, CPU)."""
import pytest
import torch
import transformers

from sparsevllm import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 8, 250, 31, 77], [11, 12], list(range(30, 70)), [200, 100, 50, 25, 12, 6]]


def hf_greedy(path, prompt, n):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "qwen2", "qwen3", "mistral"])
def test_greedy_matches_transformers_batch_1_and_batched(tiny_model, arch):
    path = tiny_model(arch)
    llm = LLM(path, page_size=4)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [hf_greedy(path, p, 12) for p in PROMPTS]
    assert llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].token_ids == expected[0]
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.cache_manager.allocator.is_idle()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_first_step_logits_match_transformers(tiny_model, arch):
    path = tiny_model(arch)
    llm = LLM(path, page_size=4)
    prompt = PROMPTS[2]
    cont = [7, 9, 13, 21]
    ours = llm.teacher_forced_logprobs([prompt], [cont], use_tqdm=False)[0]
    ref = torch.log_softmax(hf_logits(path, prompt + cont)[len(prompt) - 1:-1], dim=-1)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_matches_transformers(tiny_model):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    path = tiny_model("llama", rope_scaling=scaling, rope_theta=500000.0)
    llm = LLM(path)
    prompt = list(range(3, 120))
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(path, prompt, 8)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    from conftest import make_tiny_model
    path = make_tiny_model(tmp_path / "sharded", "qwen2", max_shard_size="60KB")
    import os
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert LLM(path).generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(path, PROMPTS[0], 8)


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.long),
                                  pytest.param("qwen3", marks=pytest.mark.long)])
def test_decode_gemms_with_the_norm_in_their_epilogues_match_transformers(tiny_model, arch, monkeypatch):
    """On a GPU, decode steps over wide weights run o_proj / down_proj with the residual add and the
    next RMSNorm (but its 1 / rms) in the GEMM's epilogue and qkv / gate_up with the rows' 1 / rms
    in theirs (RowParallelLinear.add_norm); qkv also rotates q / k and writes the cache in its own. Forced here for every step of at most 16 rows, through
    Triton's interpreter: still Hugging Face's greedy tokens (fp32)."""
    from sparsevllm.kernels import skinny_gemm
    from sparsevllm.layers import parallel_linear
    decode_sized = lambda x, w: x.numel() <= skinny_gemm.MAX_ROWS * w.shape[1]   # noqa: E731
    monkeypatch.setattr(skinny_gemm, "takes", decode_sized)
    monkeypatch.setattr(parallel_linear, "takes", decode_sized)
    monkeypatch.setattr(skinny_gemm, "num_sms", lambda device: 3)   # a few programs a launch, partial sums from each
    calls = []
    add_norm = parallel_linear.skinny_add_norm_triton
    monkeypatch.setattr(parallel_linear, "skinny_add_norm_triton", lambda *a: calls.append(1) or add_norm(*a))
    stores = []   # decode steps whose qkv GEMM did RoPE and the cache write (not with Qwen3's q/k norms)
    rope_store = parallel_linear.linear_rope_store
    monkeypatch.setattr(parallel_linear, "linear_rope_store",
                        lambda *a: stores.append(1) or rope_store(*a))
    path = tiny_model(arch)
    llm = LLM(path, page_size=4)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 6) for p in prompts]
    assert calls, "the fused path never ran"
    assert bool(stores) == (arch != "qwen3"), "RoPE and the store belong in the qkv epilogue without q/k norms"
    assert llm.engine.cache_manager.allocator.is_idle()


def test_sliding_window_caps_the_context_where_attention_is_exact(tiny_model):
    """Mistral-7B-v0.1 (and Qwen with use_sliding_window) attend over the last sliding_window
    tokens only; we attend over the whole context, which is the same only while a sequence fits
    the window. So the window caps the default max_model_len and a longer one is refused."""
    from sparsevllm.models.config import ModelConfig
    path = tiny_model("mistral", sliding_window=16)
    llm = LLM(path, page_size=4)
    assert llm.engine.config.max_model_len == 16
    prompt = PROMPTS[0]
    sp = SamplingParams(temperature=0.0, max_tokens=16 - len(prompt), ignore_eos=True)
    assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(path, prompt, 7)
    with pytest.raises(ValueError, match="sliding_window=16"):
        LLM(path, max_model_len=32)
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=28, num_attention_heads=1,
                sliding_window=131072)
    # Qwen2.5's config.json: a window that is switched off (use_sliding_window false, no layer_types)
    assert ModelConfig.from_dict(dict(base, architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
                                      max_window_layers=21)).sliding_window is None
    assert ModelConfig.from_dict(dict(base, architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                                      max_window_layers=21)).sliding_window == 131072
    assert ModelConfig.from_dict(dict(base, architectures=["LlamaForCausalLM"])).sliding_window is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_config_without_architectures_loads_by_its_model_type(tiny_model, tmp_path, arch):
    """Some config.json files name only model_type: it stands for its architecture class, and the
    model gives Hugging Face's tokens as it does with `architectures`."""
    import json
    import shutil
    path = tiny_model(arch)
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    cfg = json.loads((bare / "config.json").read_text())
    del cfg["architectures"]
    (bare / "config.json").write_text(json.dumps(cfg))
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(bare), page_size=4)
    assert llm.engine.model_config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                                    "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}[arch]
    assert llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(path, PROMPTS[0], 8)


def test_a_model_type_only_config_follows_its_architectures_sliding_window_rules():
    """Mistral applies its window to every layer, Qwen2 only with use_sliding_window, Llama never."""
    from sparsevllm.models.config import ModelConfig
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=28, num_attention_heads=1,
                sliding_window=4096)
    assert ModelConfig.from_dict(dict(base, model_type="mistral")).sliding_window == 4096
    assert ModelConfig.from_dict(dict(base, model_type="qwen2", use_sliding_window=True,
                                      max_window_layers=21)).sliding_window == 4096
    assert ModelConfig.from_dict(dict(base, model_type="qwen2")).sliding_window is None
    assert ModelConfig.from_dict(dict(base, model_type="llama")).sliding_window is None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_bias_matches_transformers(tiny_model, arch):
    """attention_bias=True (Llama-architecture conversions, Qwen3's config field) puts a bias on
    q, k, v and o_proj."""
    path = tiny_model(arch, attention_bias=True)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = LLM(path, page_size=4).generate(PROMPTS[:2], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 8) for p in PROMPTS[:2]]
