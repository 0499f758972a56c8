"""A user's mistake gets a clear error naming the knob or argument; a bad request fails alone."""
import json

import pytest

from sparsevllm import LLM, SamplingParams, available_methods
from sparsevllm.method_registry import make_config


def test_unknown_method_lists_registered_ones():
    with pytest.raises(ValueError, match="unknown vllm_sparse_method 'qeust'.*vanilla"):
        make_config(None, "qeust")


def test_sparse_method_alias(tiny_model):
    assert make_config(None, sparse_method="vanilla").vllm_sparse_method == "vanilla"
    assert make_config(None, sparse_method="quest").vllm_sparse_method == "quest"
    assert make_config(None, sparse_method="quest", quest_token_budget=64).method_config.quest_token_budget == 64
    assert make_config(None).vllm_sparse_method == "vanilla"
    llm = LLM(tiny_model("llama"), sparse_method="snapkv", device="cpu")
    assert llm.config.vllm_sparse_method == "snapkv" and llm.engine.cache_manager.method_name == "snapkv"
    assert {"vanilla", "quest", "snapkv"} <= set(available_methods())


@pytest.mark.parametrize("method,alias", [("vanilla", "quest"), ("quest", "snapkv")])
def test_contradicting_method_and_alias_is_an_error(method, alias):
    with pytest.raises(ValueError, match=f"vllm_sparse_method='{method}' and its alias sparse_method='{alias}'"):
        LLM(vllm_sparse_method=method, sparse_method=alias)
    assert make_config(None, method, sparse_method=method).vllm_sparse_method == method   # agreeing is fine


def test_unknown_knob_suggests_closest():
    with pytest.raises(ValueError, match="unknown knob 'page_sise'.*did you mean 'page_size'"):
        make_config(None, page_sise=16)


@pytest.mark.parametrize("knob,value,msg", [
    ("page_size", 12, "page_size=12 is invalid; valid: a power of two"),
    ("dtype", "fp8", "dtype='fp8' is invalid"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
    ("max_num_seqs", 0, "max_num_seqs=0"),
    ("tensor_parallel_size", 0, "tensor_parallel_size=0 is invalid; valid: an integer >= 1"),
    ("async_scheduling", "on", "async_scheduling='on' is invalid; valid: None"),
    ("gpu_memory_utilization", "0.5", "gpu_memory_utilization='0.5' is invalid; valid: a fraction"),
    ("cpu_kv_cache_gb", None, "cpu_kv_cache_gb=None is invalid"),
    ("enforce_eager", "yes", "enforce_eager='yes' is invalid; valid: True or False"),
    ("enable_prefix_caching", "no", "enable_prefix_caching='no' is invalid"),
    ("seed", "x", "seed='x' is invalid; valid: an integer"),
])
def test_invalid_engine_knob_values(knob, value, msg):
    with pytest.raises(ValueError, match=msg):
        make_config(None, **{knob: value})


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_prompt_too_long_and_empty_prompt_fail_alone(tiny_model):
    llm = LLM(tiny_model("llama"), max_model_len=64)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], list(range(3, 100)), [], [9, 10]], sp, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "max_model_len=64" in outs[1].error
    assert "empty prompt" in outs[2].error
    assert len(outs[0].outputs[0].token_ids) == 4 and len(outs[3].outputs[0].token_ids) == 4
    assert llm.engine.cache_manager.allocator.is_idle()


def test_request_larger_than_kv_pool_fails_alone(tiny_model):
    llm = LLM(tiny_model("llama"), num_kv_pages=4, page_size=16)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([list(range(3, 200)), [5, 6, 7]], sp, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "num_kv_pages" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "length"
    # One that fits at admission but outgrows the pool while decoding also fails alone.
    sp_long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    out = llm.generate([list(range(3, 40))], sp_long, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and "no longer fits" in out.error
    assert llm.engine.cache_manager.allocator.is_idle()


def test_failed_requests_leave_nothing_of_theirs_in_the_engine(tiny_model):
    """Seeded samples refused at arrival, and seeded samples that outgrow the pool while decoding:
    their generators used to stay in the engine for good (a server kept one per such sample)."""
    llm = LLM(tiny_model("llama"), num_kv_pages=4, page_size=16)
    sp = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=200, ignore_eos=True)
    outs = llm.generate([list(range(3, 200)), list(range(3, 40))], sp, use_tqdm=False)
    assert [o.finish_reason for out in outs for o in out.outputs] == ["error"] * 4
    assert "num_kv_pages" in outs[0].error and "no longer fits" in outs[1].error
    eng = llm.engine
    assert not eng._seq_generators and not eng.has_work() and eng.cache_manager.allocator.is_idle()


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10,
                                                      "hidden_size": 8, "intermediate_size": 8,
                                                      "num_hidden_layers": 1, "num_attention_heads": 2}))
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_unreadable_model_folder(tmp_path):
    with pytest.raises(ValueError, match="no readable config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="is not a folder"):
        LLM(str(tmp_path / "missing"))


def test_missing_weights_is_reported(tmp_path, tiny_model):
    import shutil
    src = tiny_model("llama")
    shutil.copy(f"{src}/config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="no \\*.safetensors weights.*load_format='dummy'"):
        LLM(str(tmp_path))
    assert LLM(str(tmp_path), load_format="dummy").generate([[1, 2, 3]], SamplingParams(max_tokens=2),
                                                            use_tqdm=False)[0].outputs[0].finish_reason in ("length", "stop")


def test_string_prompt_without_tokenizer_is_explained(tiny_model):
    llm = LLM(tiny_model("llama"))
    with pytest.raises(ValueError, match="no tokenizer: pass prompts as token-id lists"):
        llm.generate("hello", use_tqdm=False)


def test_a_gpt2_config_names_the_unsupported_architecture(tmp_path):
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2,
           "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'; supported: Llama"):
        LLM(str(tmp_path), device="cpu")


def test_a_config_naming_only_an_unknown_model_type_names_it_and_the_supported_architectures(tmp_path):
    cfg = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture 'gpt2'; supported: LlamaForCausalLM, "
                                         "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(str(tmp_path), device="cpu")


def test_cli_prints_errors_without_a_traceback_and_shows_defaults(tiny_model):
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "sparsevllm", *args], capture_output=True, text=True, timeout=300)
    out = cli("--model", tiny_model("llama"), "--hyper_params", "{bad")
    assert out.returncode == 2 and "--hyper_params is not valid JSON" in out.stderr and "Traceback" not in out.stderr
    out = cli("--model", tiny_model("llama"), "--method", "nosuch")
    assert out.returncode == 2 and "unknown vllm_sparse_method 'nosuch'" in out.stderr
    assert "Traceback" not in out.stderr
    out = cli("--model", tiny_model("llama"), "--chat", "hi")   # a model without a chat template
    assert out.returncode == 2 and "no chat template" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "(default: 32)" in cli("--help").stdout


def test_out_of_range_logprobs_and_stop_token_ids_fail_alone(tiny_model):
    """A top-k larger than the vocabulary or a stop token id outside it once failed in the sampler,
    taking down the whole step and leaving the request in the engine for every later call."""
    llm = LLM(tiny_model("llama"), max_model_len=64)   # vocabulary of 256
    ok = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    bad = [ok.clone(logprobs=1000), ok.clone(prompt_logprobs=257), ok.clone(min_tokens=2, stop_token_ids=[10**6])]
    outs = llm.generate([[5, 6, 7]] * 4, bad + [ok], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error"] * 3 + ["length"]
    assert "logprobs=1000" in outs[0].error and "prompt_logprobs=257" in outs[1].error
    assert "stop_token_ids" in outs[2].error
    assert len(llm.generate([[5, 6]], ok.clone(logprobs=256), use_tqdm=False)[0].outputs[0].logprobs) == 3
    assert llm.engine.cache_manager.allocator.is_idle() and not llm.engine.has_work()


def test_a_generate_call_that_raises_leaves_no_request_behind(tiny_model):
    """vLLM's rule: requests queued before the error are aborted, not run (and their pages held)
    inside the next call."""
    llm = LLM(tiny_model("llama"), max_model_len=64)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate([[5, 6, 7], "a string, and this model has no tokenizer"], sp, use_tqdm=False)
    assert not llm.engine.has_work() and llm.engine.cache_manager.allocator.is_idle()
    forward, calls = llm.engine.model_runner.forward, []

    def failing_forward(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return forward(*args)
    llm.engine.model_runner.forward = failing_forward
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate([[5, 6, 7], [8, 9]], sp, use_tqdm=False)
    assert not llm.engine.has_work() and llm.engine.cache_manager.allocator.is_idle()
    out = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


def test_seeds_at_the_ends_of_the_generators_range(tiny_model):
    """n samples seed their generators seed, seed + 1, ...: at 2**64 - 1 the second once overflowed
    torch's generator after the first sample was queued, which then stayed in the engine."""
    llm = LLM(tiny_model("llama"), max_model_len=64)
    for seed in (2**64 - 1, -2**63):
        out = llm.generate([[5, 6, 7]], SamplingParams(n=2, seed=seed, max_tokens=3, ignore_eos=True),
                           use_tqdm=False)[0]
        assert [o.finish_reason for o in out.outputs] == ["length", "length"]
    assert not llm.engine.has_work() and llm.engine.cache_manager.allocator.is_idle()


@pytest.mark.parametrize("field, value", [("hidden_act", "gelu"), ("mlp_bias", True)])
def test_config_fields_the_models_do_not_implement_are_named(tiny_model, field, value):
    """Hugging Face builds these (another activation; biases on gate/up/down) and our MLP does not:
    refused by name, not silently computed with SiLU or failing on an unplaced checkpoint tensor."""
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        LLM(tiny_model("llama", **{field: value}))


@pytest.mark.parametrize("field, value", [("vocab_size", 200), ("intermediate_size", 96), ("head_dim", 8),
                                          ("num_key_value_heads", 1)])
def test_a_config_that_does_not_match_its_checkpoint_is_refused(tmp_path, tiny_model, field, value):
    """Hugging Face refuses checkpoint tensors of another shape than config.json implies; reading
    the first rows or columns of a larger tensor would load a different model without a word."""
    import shutil
    src = tiny_model("llama")
    shutil.copy(f"{src}/model.safetensors", tmp_path / "model.safetensors")
    cfg = json.loads(open(f"{src}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, **{field: value})))
    with pytest.raises(ValueError, match="checkpoint shape .* does not match config.json"):
        LLM(str(tmp_path))


def test_extra_and_missing_checkpoint_tensors_are_all_listed_by_their_checkpoint_names(tmp_path, tiny_model):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    src = tiny_model("llama")
    shutil.copy(f"{src}/config.json", tmp_path / "config.json")
    sd = load_file(f"{src}/model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"], sd["model.norm.weight"]
    sd["model.layers.0.self_attn.extra.weight"], sd["model.foo"] = torch.zeros(1), torch.zeros(1)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        LLM(str(tmp_path))
    for name in ("model.layers.0.self_attn.extra.weight", "model.foo", "model.layers.1.mlp.up_proj.weight",
                 "model.norm.weight"):
        assert repr(name) in str(e.value)


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
                                     {"type": "dynamic", "factor": 2.0}])
def test_unsupported_rope_scaling_is_named(tiny_model, scaling):
    """Llama-3.1's llama3 and linear scaling are implemented; another kind would rotate differently."""
    kind = scaling.get("rope_type", scaling.get("type"))
    with pytest.raises(ValueError, match=f"rope_scaling type '{kind}'.*supported: default, linear, llama3"):
        LLM(tiny_model("llama", rope_scaling=scaling))
