"""The generic attention layer: the same code for every sparse method.

project (model) -> store_kv (RoPE + the cache write; on decode steps the model's qkv projection
does it instead where the cache manager's store_target names the cache) -> on_kv_stored -> prefill
(observe_prefill_queries, then attention over prefill_view), or decode over build_decode_view.
Method behaviour enters only through those cache-manager hooks. The step arrives as an argument
(the model passes it down); the cache manager is the one the model runner binds to every layer.
"""
import os

import torch
from torch import nn

from sparsevllm.engine.recall import measured_attention
from sparsevllm.engine.step import StepState, StoreTarget
from sparsevllm.kernels.decode_attention import decode_attention
from sparsevllm.kernels.prefill_attention import prefill_attention
from sparsevllm.layers.rotary_embedding import RotaryEmbedding

FUSED_ROPE_STORE = os.environ.get("SPARSEVLLM_FUSED_ROPE_STORE", "1") != "0"


class Attention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 rope: RotaryEmbedding):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.rope = rope
        self.cache_manager = None   # set once by the model runner (ModelRunner.__init__)

    def store_target(self, step: StepState) -> StoreTarget | None:
        """Where this layer's qkv projection may rotate and write K/V itself on a decode step (the
        GEMM's epilogue, one launch fewer than projecting and then store_kv), or None. The cache
        manager names it (store_target); SPARSEVLLM_FUSED_ROPE_STORE=0 always says None (A/B)."""
        if not FUSED_ROPE_STORE:
            return None
        return self.cache_manager.store_target(self.layer_id, step)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepState,
                stored: bool = False) -> torch.Tensor:
        """q: [T, H_q, D], k/v: [T, H_kv, D] before RoPE -> [T, H_q, D]. stored: the projection
        already rotated q, k and wrote k, v where store_target said."""
        cm = self.cache_manager
        if not stored:
            q, k = cm.store_kv(self.layer_id, q, k, v, self.rope.cos_sin_cache, step)
        cm.on_kv_stored(self.layer_id, k, v, step)
        if step.is_prefill:
            cm.observe_prefill_queries(self.layer_id, q, step)
            view = cm.prefill_view(self.layer_id, step)
            return prefill_attention(q, k, v, view.k_cache, view.v_cache, view.block_tables, step.cu_seqlens_q,
                                     view.cache_lens, step.max_seqlen_q, step.has_prefix, view.page_size,
                                     self.scale, step.num_tokens, view.k_scale, view.v_scale)
        view = cm.build_decode_view(self.layer_id, q, step)
        if step.recall is not None:   # a sampled step (recall_sample_every): also measured against the dense view
            return measured_attention(self.layer_id, q, view, self.scale, cm, step)
        return decode_attention(q, view.k_cache, view.v_cache, view.table, view.lengths, view.page_size,
                                self.scale, view.token_scores, view.k_scale, view.v_scale)
