"""The embedded default model (SmolLM2-135M-Instruct) through the engine, on CPU."""
import pytest

from sparsevllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4, cpu_kv_cache_gb=0.5)


def test_capital_of_france_continues_with_paris(llm):
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_chat_question_gets_a_sensible_answer(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"


def test_named_default_model_is_the_same(llm):
    assert LLM("smollm2-135m", cpu_kv_cache_gb=0.1).engine.model_path == llm.engine.model_path
