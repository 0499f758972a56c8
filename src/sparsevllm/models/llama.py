"""Llama-family decoder: Llama 2/3/3.1, Mistral, SmolLM2; Qwen2 (qkv bias) and Qwen3 (q/k norm)
are the same graph with a flag each (see qwen2.py, qwen3.py).

Tensor parallel (Megatron split): a rank holds its query and KV heads of the fused QKV projection
and its columns of gate_up, so attention and the activation run on local heads/columns; o_proj
and down_proj are row-parallel and all-reduce their partial sums: two collectives per layer. With
one rank every parallel layer is a plain linear."""
import torch
from torch import nn

from sparsevllm.engine.step import StepState
from sparsevllm.layers.attention import Attention
from sparsevllm.layers.layernorm import RMSNorm
from sparsevllm.layers.parallel_linear import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                               RowParallelLinear, VocabParallelEmbedding)
from sparsevllm.layers.rotary_embedding import RotaryEmbedding
from sparsevllm.models.config import ModelConfig


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, qkv_bias: bool, qk_norm: bool, rope: RotaryEmbedding):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=qkv_bias or cfg.attention_bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size   # this rank's heads
        self.num_heads, self.num_kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        # attention_bias (Llama / Qwen3 config field, as in Hugging Face): a bias on q, k, v and o_proj.
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, rope)

    def forward(self, x: torch.Tensor, row_norm, residual: torch.Tensor, norm: RMSNorm, step: StepState):
        """-> norm(o_proj(attention) + residual) as RowParallelLinear.add_norm returns it."""
        # Decode: the qkv GEMM may rotate q / k and write the cache in its epilogue (not with q/k
        # norms, which come between the projection and RoPE).
        target = self.attn.store_target(step) if self.q_norm is None else None
        qkv = self.qkv_proj.rope_store(x, row_norm, target, self.attn.rope.cos_sin_cache, self.head_dim) \
            if target is not None else None
        stored = qkv is not None
        if not stored:
            qkv = self.qkv_proj(x, row_norm)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        o = self.attn(q, k, v, step, stored)   # else RoPE at the step's positions happens there, fused with the cache write
        return self.o_proj.add_norm(o.reshape(-1, self.q_size), residual, norm)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, row_norm, residual, norm):
        return self.down_proj.add_norm(self.gate_up_proj.silu_mul(x, row_norm), residual, norm)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id, qkv_bias, qk_norm, rope):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer_id, qkv_bias, qk_norm, rope)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, row_norm, next_norm, step: StepState):
        """x: the embedding (residual None, normed here) or this layer's input already added and
        normed by the layer before's down_proj (RowParallelLinear.add_norm with this layer's
        input_layernorm; with row_norm, all but each row's 1 / rms, which qkv_proj applies).
        Returns the same for the next layer, normed by next_norm (None: the MLP's output and the
        residual, for the caller to add and norm)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        x, residual, row_norm = self.self_attn(x, row_norm, residual, self.post_attention_layernorm, step)
        return self.mlp(x, row_norm, residual, next_norm)


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    # HF checkpoint name -> (our packed parameter, shard index); shard order follows the packing.
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.qkv_bias, self.qk_norm, self.rope)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size,
                                      tied_to=self.embed_tokens if cfg.tie_word_embeddings else None)

    def shard_sizes(self, packed: str) -> list[int]:
        c = self.cfg
        if packed == "qkv_proj":
            return [c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                    c.num_key_value_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]

    def forward(self, step: StepState) -> torch.Tensor:
        """The hidden states of the step's tokens (step.input_ids at step.positions); the attention
        layers read and write the KV cache through the step and their cache manager."""
        x, residual, row_norm = self.embed_tokens(step.input_ids), None, None
        for i, layer in enumerate(self.layers):
            last = i + 1 == len(self.layers)
            x, residual, row_norm = layer(x, residual, row_norm, None if last else self.layers[i + 1].input_layernorm,
                                          step)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor | None:
        """Logits on rank 0; None on the other ranks (only rank 0 samples). gather=False: this
        rank's vocab slice, completed later by gather_logits (CUDA graphs capture up to the slice)."""
        return self.lm_head(hidden, gather)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.gather(local)
