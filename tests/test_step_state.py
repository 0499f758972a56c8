"""The engine's construction and step state (docs/design.md, sections 2 and 3): one cache manager,
built once and shared by the runner, the scheduler and every attention layer; one fresh StepState a
step, carried from on_step_begin through the forward's hooks to on_step_end."""
from method_knobs import METHOD_KNOBS
from sparsevllm import LLM, SamplingParams
from sparsevllm.layers.attention import Attention

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_one_cache_manager_is_built_and_shared(tiny_model):
    llm = LLM(tiny_model("llama"), "quest", device="cpu", page_size=4, **METHOD_KNOBS["quest"])
    eng = llm.engine
    cm = eng.cache_manager
    layers = [m for m in eng.model_runner.model.modules() if isinstance(m, Attention)]
    assert layers and all(layer.cache_manager is cm for layer in layers)
    assert eng.model_runner.cache_manager is cm and eng.scheduler.cm is cm
    assert type(cm) is llm.config.method   # the class make_config looked up, once


def test_each_step_is_a_fresh_state_from_on_step_begin_to_on_step_end(tiny_model, monkeypatch):
    llm = LLM(tiny_model("llama"), "omnikv", device="cpu", page_size=4, **METHOD_KNOBS["omnikv"])
    cm = type(llm.engine.cache_manager)
    begun, ended, seen = [], [], []
    begin, end, view = cm.on_step_begin, cm.on_step_end, cm.build_decode_view

    def on_step_begin(self, step):
        assert not step.scratch   # nothing carried over from an earlier step
        begun.append(step)
        return begin(self, step)

    def on_step_end(self, step):
        ended.append(step)
        return end(self, step)

    def build_decode_view(self, layer_id, q, step):
        seen.append(step)
        return view(self, layer_id, q, step)
    monkeypatch.setattr(cm, "on_step_begin", on_step_begin)
    monkeypatch.setattr(cm, "on_step_end", on_step_end)
    monkeypatch.setattr(cm, "build_decode_view", build_decode_view)
    prompt = list(range(3, 120))
    llm.generate([prompt, prompt[:50]], GREEDY, use_tqdm=False)
    assert [id(s) for s in begun] == [id(s) for s in ended]   # the same object, begin to end
    assert len({id(s) for s in begun}) == len(begun) >= GREEDY.max_tokens   # a new one every step
    assert seen and all(any(s is b for b in begun) for s in seen)
    # the filter layer's scores were handed on through the step that ran them
    assert any(any(key.startswith("omnikv.") for key in s.scratch) for s in begun if not s.is_prefill)
