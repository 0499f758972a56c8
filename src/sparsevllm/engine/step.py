"""The per-step types: what one forward step reads (StepState) and what one attention reads
(PrefillView, DecodeView). The model runner builds the step (`ModelRunner.prepare_step`), the cache
manager adds its extras and builds the views; the model passes the step down to its attention layers."""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sparsevllm.engine.sequence import Sequence

if TYPE_CHECKING:
    from sparsevllm.engine.recall import RecallSample


@dataclass
class DecodeView:
    """What one decode attention reads: row (b, g) covers pages table[b, g, :ceil(len / P)] of
    k_cache / v_cache. G = 1 (shared by all KV heads), H_kv (one set per KV head) or H_q (one set
    per query head: a GQA group's query heads then read their KV head's pages separately).
    token_scores (optional, G = 1): an fp32 [B, H_kv, N * P] buffer the attention fills with each
    token's raw logit max over each KV group's query heads, for a method that selects from them
    (an OmniKV filter layer) without reading the keys again. k_scale / v_scale: an FP8 cache's
    [num_slots, H_kv] fp32 scales, indexed like k_cache / v_cache (None: the cache holds the values)."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    table: torch.Tensor      # [B, G, N] int32
    lengths: torch.Tensor    # [B, G] int32
    page_size: int
    token_scores: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass
class PrefillView:
    """What prefill attention reads: the chunk's queries attend to keys [0, cache_lens[i]) of
    request i through its block table (prefix + the chunk itself, already stored). k_scale /
    v_scale: an FP8 cache's scales, as in DecodeView."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor   # [B, N] int32
    cache_lens: torch.Tensor     # [B] int32
    page_size: int
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass
class StoreTarget:
    """Where a decode step's new K/V go, for a projection that writes them itself (the qkv GEMM's
    epilogue on decode steps: RoPE, the write, and optionally per-page key bounds, in the launch
    that computes them). slot_mapping / positions: [T] as in StepState; page_min / page_max:
    [num_pages, H_kv, D] channel-wise bounds of each page's keys to fold each new key into, or None.
    Never for an FP8 cache: the epilogue does not quantize (store_target says None, rope_store writes)."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    page_min: torch.Tensor | None = None
    page_max: torch.Tensor | None = None
    page_size: int = 1


@dataclass
class StepState:
    """Everything one forward step needs, built once by `ModelRunner.prepare_step` and passed down
    to every hook. The engine makes one per step and drops it after the step's `on_step_end`."""
    is_prefill: bool
    seqs: list[Sequence]
    num_tokens: list[int]            # new tokens per request this step
    sampled: list[int]               # requests (batch rows) whose last token's logits are sampled
    input_ids: torch.Tensor          # [T]; a token still being sampled is 0 here until `feed` fills it
    positions: torch.Tensor          # [T] logical (RoPE) positions
    slot_mapping: torch.Tensor       # [T] pool slot of each new token, -1 = write nowhere
    block_tables: torch.Tensor       # [B, N] int32, padded with 0
    cache_lens: torch.Tensor         # [B] int32: cache length after this step's tokens are stored
    cu_seqlens_q: torch.Tensor       # [B+1] int32 (prefill)
    max_seqlen_q: int = 1
    has_prefix: bool = False         # prefill: some chunk attends to earlier stored tokens
    # token rows whose logits are computed: the prompt-logprob rows first, then one per sampled request
    logits_indices: torch.Tensor | None = None
    # (batch index, first position, count): prompt positions whose next-token log-probabilities a
    # request asked for (prompt_logprobs), in the order of their logits rows
    prompt_logprob_rows: list[tuple[int, int, int]] = field(default_factory=list)
    # Decode under overlapped scheduling: row i's input token is the previous step's sampled token
    # feed_rows[i] (-1: input_ids[i] is already right). None when no input waits on the device.
    feed_rows: torch.Tensor | None = None
    # Method-owned per-step tensors (e.g. selection buffers), set by the cache manager's
    # `on_step_begin`. The model runner copies decode ones into static CUDA-graph buffers like every
    # other tensor field (`graph_extras` declares them).
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    # Method-owned per-step state that is no graph input: what one hook hands to a later hook of the
    # same step (a filter layer's token scores to the layers after it, a compaction's kept tokens
    # to on_step_end). Under CUDA graphs it is filled once, while the graph is captured.
    scratch: dict[str, object] = field(default_factory=dict)
    # Which captured decode graph replays this step (CacheManager.graph_variants): set by the runner
    # from `graph_variant(step)` after `on_step_begin`; "" = the general one.
    graph_variant: str = ""
    # Attention-recall measurements (engine/recall.py): set by the runner when recall_sample_every
    # marks rows of a decode step (which then runs eagerly) and on every prefill step; None otherwise.
    recall: "RecallSample | None" = None

    @property
    def batch_size(self) -> int:
        return len(self.seqs)
