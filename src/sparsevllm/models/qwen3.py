from sparsevllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True  # Qwen3 RMS-normalises each head of q and k before RoPE
