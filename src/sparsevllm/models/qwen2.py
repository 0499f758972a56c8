from sparsevllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True  # Qwen2/2.5 put a bias on the q, k and v projections
