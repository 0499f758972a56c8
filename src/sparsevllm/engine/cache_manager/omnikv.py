"""omnikv: filter layers choose the tokens the layers after them attend to (OmniKV, "Dynamic
Context Selection for Efficient Long-Context LLMs", ICLR 2025; code: antgroup/OmniKV).

The observation: within one decode step, consecutive layers attend to much the same tokens, so a
few "filter" layers can pick the tokens for the layers that follow them, and nothing need be
dropped from the cache ("token-dropping free").

Layer roles (`omnikv_filter_layers` F, `omnikv_wait_layers` W): the layers before F[0], every
filter layer and the W layers after each are dense; every other layer is sparse and uses the
selection of the nearest filter layer before it. Each decode step, each filter layer scores every
prompt token j with its own current query: max over query heads h of q_h . k_j / sqrt(d) (raw
logits, selector "last", OmniKV's default; "softmax_max" takes the max over heads of the softmax
probabilities instead, each head's softmax over the prompt's keys only, as the official
`softmax_before_last` slices the key cache to the prompt before it) and keeps the top n
(`omnikv_num_selected`: an int, or a fraction of the prompt length, default 0.067). Its sparse
layers then attend to those n prompt tokens plus every generated token, which are always attended
and never selected: one token set shared by all heads, a decode view with page size 1 and G = 1,
positions in logical order (all below the query's).
Prefill is dense everywhere; nothing is evicted, so prefix caching and chunked prefill work as for
vanilla, except that only prompt pages are shared (a generated token's KV comes from the sparse
decode, not what a miss would prefill: `dense_decode=False`). The selection is handed from a
filter layer to its sparse layers through the step (`cross_layer.py`).

Defaults per model depth L: the paper's filter layers 2, 8, 18 on 32 layers, scaled to round(f * L
/ 32) (SmolLM2's 30 layers: 2, 8, 17); `python -m sparsevllm.tools.omnikv_calibrate` picks them
for a model from sample prompts.

Deviations from the official code:
- n as a fraction of the prompt rounds up (ceil(0.067 * L)), at least one token.
- Memory: none is saved (the paper's optional offload of the sparse layers' prompt KV to host
  memory is not implemented).
- The top-n is exact (ties to the earlier position); the official code calls torch.topk.
- Preemption recomputes prompt + generated tokens by (dense) prefill, so the generated tokens'
  K/V in the sparse layers come from dense attention instead of the selection they were decoded
  with: a preempted request's continuation can differ from an uninterrupted run from the
  preemption on. The official code has no preemption.
"""
import math
from dataclasses import dataclass

import numpy as np
import torch

from sparsevllm.config import EngineConfig, MethodConfig, is_int
from sparsevllm.distributed import combine_shared_scores
from sparsevllm.engine.cache_manager.base import CacheManager, Capabilities
from sparsevllm.engine.cache_manager.cross_layer import layer_roles, scored_view, selection
from sparsevllm.engine.staging import to_device
from sparsevllm.engine.step import DecodeView, StepState
from sparsevllm.kernels.omnikv import SELECTORS, omnikv_scores
from sparsevllm.kernels.token_select import select_tokens
from sparsevllm.models.config import ModelConfig

PAPER_FILTER_LAYERS, PAPER_DEPTH = (2, 8, 18), 32


def default_filter_layers(num_layers: int) -> list[int]:
    """The paper's 2, 8, 18 on 32 layers, scaled to the model's depth."""
    return sorted({min(num_layers - 1, round(f * num_layers / PAPER_DEPTH)) for f in PAPER_FILTER_LAYERS})


@dataclass
class OmniKVConfig(MethodConfig):
    omnikv_filter_layers: list[int] | None = None   # None: the paper's 2, 8, 18 scaled to the depth
    omnikv_wait_layers: int = 1                     # dense layers right after each filter layer
    omnikv_num_selected: int | float = 0.067        # prompt tokens kept: a count, or a fraction of the prompt
    omnikv_selector: str = "last"                   # last (raw logits, max over heads) | softmax_max

    def validate(self, engine: EngineConfig) -> None:
        f = self.omnikv_filter_layers
        if f is not None:
            self.need(isinstance(f, (list, tuple)) and len(f) > 0 and all(is_int(x) and x >= 0 for x in f)
                      and list(f) == sorted(set(f)), "omnikv_filter_layers", "None (the paper's 2, 8, 18 scaled to "
                      "the model's depth) or a non-empty, strictly increasing list of layer ids >= 0")
            self.omnikv_filter_layers = list(f)
        self.need(is_int(self.omnikv_wait_layers) and self.omnikv_wait_layers >= 0, "omnikv_wait_layers",
                  "an integer >= 0")
        n = self.omnikv_num_selected
        self.need((is_int(n) and n >= 1) or (isinstance(n, float) and 0.0 < n <= 1.0), "omnikv_num_selected",
                  "an integer >= 1 (tokens) or a fraction in (0, 1] of the prompt length")
        self.need(self.omnikv_selector in SELECTORS, "omnikv_selector", " | ".join(SELECTORS))

    def num_kept(self, prompt_len: int) -> int:
        n = self.omnikv_num_selected
        n = n if isinstance(n, int) else math.ceil(n * prompt_len)
        return max(1, min(prompt_len, n))


class OmniKVCacheManager(CacheManager):
    method_name = "omnikv"
    # The filter layer's token scores (max over heads) are combined with a max all-reduce across
    # ranks before top-k, so every rank attends the same tokens.
    capabilities = Capabilities(tensor_parallel=True, dense_decode=False)
    config_cls = OmniKVConfig
    request_knobs = ("omnikv_num_selected",)   # prompt tokens kept per request: omnikv_keep, a decode extra
    recall_definition = ("exact: per sparse layer, the share of the dense softmax mass (every token the request "
                         "holds, per query head, averaged over heads) on the filter layer's selected prompt tokens "
                         "and every generated token; dense and filter layers are not measured")

    def __init__(self, *args):
        super().__init__(*args)
        knobs = self.method_config
        self.filter_layers = knobs.omnikv_filter_layers or default_filter_layers(self.num_layers)
        self.roles = layer_roles(self.num_layers, self.filter_layers, knobs.omnikv_wait_layers)
        self.selector = knobs.omnikv_selector
        self.scale = self.head_dim ** -0.5

    @classmethod
    def validate_model(cls, config: EngineConfig, model_config: ModelConfig) -> None:
        f, num_layers = config.method_config.omnikv_filter_layers, model_config.num_hidden_layers
        if f is not None and f[-1] >= num_layers:
            raise ValueError(f"omnikv_filter_layers={f} is out of range for a model of {num_layers} layers; "
                             f"valid: layer ids in [0, {num_layers - 1}]")

    @classmethod
    def decode_kv_tokens_read(cls, config: EngineConfig, model_config: ModelConfig, prompt_len: int,
                              cache_len: int) -> float:
        """Dense layers read the whole cache (a filter layer's scores with the default selector come
        out of its own attention; softmax_max reads the prompt's keys twice more: half a token's
        K + V each time); sparse layers read the kept prompt tokens and every generated one."""
        knobs, num_layers = config.method_config, model_config.num_hidden_layers
        filters = knobs.omnikv_filter_layers or default_filter_layers(num_layers)
        roles = layer_roles(num_layers, filters, knobs.omnikv_wait_layers)
        kept = knobs.num_kept(prompt_len) + cache_len - prompt_len
        scoring = prompt_len if knobs.omnikv_selector == "softmax_max" else 0
        total = sum(kept if role == "sparse" else cache_len + (scoring if role == "filter" else 0)
                    for role, _ in roles)
        return total / num_layers

    def on_step_begin(self, step: StepState) -> None:
        if not step.is_prefill:
            plens = [s.num_prompt_tokens for s in step.seqs]
            both = to_device(np.array([plens, [self.num_kept(s) for s in step.seqs]], dtype=np.int32),
                             self.device, torch.int32)
            step.extras["omnikv_prompt_lens"], step.extras["omnikv_keep"] = both[0], both[1]

    def num_kept(self, seq) -> int:
        """Prompt tokens seq's sparse layers keep: by its own omnikv_num_selected (SparseParams) or the
        engine's; all of them for a request that decodes densely (its view then holds every token, in
        order: vanilla's attention)."""
        knobs = self.request_config(seq)
        return seq.num_prompt_tokens if knobs is None else knobs.num_kept(seq.num_prompt_tokens)

    def graph_extras(self, max_batch_size: int) -> dict[str, torch.Tensor]:
        # Padding rows: a one-token prompt, one token kept.
        return {k: torch.ones(max_batch_size, dtype=torch.int32, device=self.device)
                for k in ("omnikv_prompt_lens", "omnikv_keep")}

    def build_decode_view(self, layer_id: int, q: torch.Tensor, step: StepState) -> DecodeView:
        role, source = self.roles[layer_id]
        if role == "dense":
            return super().build_decode_view(layer_id, q, step)
        if role == "filter":
            view = super().build_decode_view(layer_id, q, step)
            if self.selector == "last":   # scores out of its own dense attention, [B, H_kv, T]
                return scored_view(view, step, f"omnikv.{layer_id}")
            step.scratch[f"omnikv.{layer_id}"] = omnikv_scores(
                q, self.pool.layer(layer_id)[0], step.block_tables, step.cache_lens,
                step.extras["omnikv_prompt_lens"], self.page_size, self.scale, self.selector,
                self.pool.scales(layer_id)[0])
            return view
        table, lengths = selection(step, f"omnikv.{source}", lambda scores: self._select(scores, step))
        k_cache, v_cache = self.pool.layer(layer_id)
        k_scale, v_scale = self.pool.scales(layer_id)
        return DecodeView(k_cache, v_cache, table, lengths, 1, k_scale=k_scale, v_scale=v_scale)

    def recall_view(self, layer_id: int, step: StepState) -> DecodeView | None:
        return CacheManager.build_decode_view(self, layer_id, None, step) if self.roles[layer_id][0] == "sparse" else None

    def _select(self, scores: torch.Tensor, step: StepState):
        if scores.dim() == 3:    # the filter attention's per-group maxima: [B, H_kv, T] -> [B, T]
            scores = scores.amax(dim=1)
        scores = combine_shared_scores(scores)   # the max over every rank's heads
        return select_tokens(scores, step.extras["omnikv_keep"], step.block_tables, step.cache_lens,
                             step.extras["omnikv_prompt_lens"], self.page_size)
