"""Generate with the embedded default model (SmolLM2-135M-Instruct) on CPU or GPU.

    python examples/quickstart.py
"""
from sparsevllm import LLM, SamplingParams

llm = LLM()
greedy = SamplingParams(temperature=0.0, max_tokens=24)
for out in llm.generate(["The capital of France is", "Water boils at"], greedy, use_tqdm=False):
    print(repr(out.outputs[0].text), out.outputs[0].finish_reason)
answer = llm.chat([{"role": "user", "content": "Name three primary colors."}], greedy, use_tqdm=False)[0]
print(answer.outputs[0].text)
print("ran as", llm.execution_mode, "on", llm.engine.model_runner.device)
