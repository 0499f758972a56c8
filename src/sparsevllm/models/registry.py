from sparsevllm.models.llama import LlamaForCausalLM
from sparsevllm.models.qwen2 import Qwen2ForCausalLM
from sparsevllm.models.qwen3 import Qwen3ForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str):
    if architecture not in MODELS:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {', '.join(MODELS)}")
    return MODELS[architecture]
