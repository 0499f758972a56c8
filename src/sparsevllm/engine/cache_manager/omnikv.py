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
filter layer to its sparse layers through the SparseController (put/get), within the step.

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

from sparsevllm.config import EngineConfig, MethodConfig
from sparsevllm.distributed import combine_shared_scores
from sparsevllm.engine.cache_manager.base import CacheManager, Capabilities
from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.staging import to_device
from sparsevllm.engine.step import DecodeView, StepState
from sparsevllm.forward_context import get_forward_context
from sparsevllm.kernels.omnikv import SELECTORS, omnikv_scores
from sparsevllm.kernels.token_select import select_tokens
from sparsevllm.models.config import ModelConfig

PAPER_FILTER_LAYERS, PAPER_DEPTH = (2, 8, 18), 32


def default_filter_layers(num_layers: int) -> list[int]:
    """The paper's 2, 8, 18 on 32 layers, scaled to the model's depth."""
    return sorted({min(num_layers - 1, round(f * num_layers / PAPER_DEPTH)) for f in PAPER_FILTER_LAYERS})


def layer_roles(num_layers: int, filter_layers: list[int], wait: int) -> list[tuple[str, int | None]]:
    """Per layer ("dense", None) | ("filter", None) | ("sparse", the filter layer it follows)."""
    roles, last, since = [], None, 0
    for layer in range(num_layers):
        if layer in filter_layers:
            roles.append(("filter", None))
            last, since = layer, 0
        elif last is None or since < wait:
            roles.append(("dense", None))
            since += 1
        else:
            roles.append(("sparse", last))
    return roles


@dataclass
class OmniKVConfig(MethodConfig):
    omnikv_filter_layers: list[int] | None = None   # None: the paper's 2, 8, 18 scaled to the depth
    omnikv_wait_layers: int = 1                     # dense layers right after each filter layer
    omnikv_num_selected: int | float = 0.067        # prompt tokens kept: a count, or a fraction of the prompt
    omnikv_selector: str = "last"                   # last (raw logits, max over heads) | softmax_max

    def validate(self, engine: EngineConfig) -> None:
        f = self.omnikv_filter_layers
        if f is not None:
            ok = isinstance(f, (list, tuple)) and len(f) > 0 and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in f)
            if not ok or list(f) != sorted(set(f)):
                raise ValueError(f"omnikv_filter_layers={f!r} is invalid; valid: None (the paper's 2, 8, 18 scaled "
                                 "to the model's depth) or a non-empty, strictly increasing list of layer ids >= 0")
            self.omnikv_filter_layers = list(f)
        w = self.omnikv_wait_layers
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ValueError(f"omnikv_wait_layers={w!r} is invalid; valid: an integer >= 0")
        n = self.omnikv_num_selected
        is_int = isinstance(n, int) and not isinstance(n, bool)
        if not ((is_int and n >= 1) or (isinstance(n, float) and 0.0 < n <= 1.0)):
            raise ValueError(f"omnikv_num_selected={n!r} is invalid; valid: an integer >= 1 (tokens) or a "
                             "fraction in (0, 1] of the prompt length")
        if self.omnikv_selector not in SELECTORS:
            raise ValueError(f"omnikv_selector={self.omnikv_selector!r} is invalid; valid: " + " | ".join(SELECTORS))

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

    def __init__(self, config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_pages: int, dtype: torch.dtype, device: torch.device):
        super().__init__(config, num_layers, num_kv_heads, head_dim, num_pages, dtype, device)
        knobs = self.method_config
        self.filter_layers = knobs.omnikv_filter_layers or default_filter_layers(num_layers)
        self.roles = layer_roles(num_layers, self.filter_layers, knobs.omnikv_wait_layers)
        self.selector = knobs.omnikv_selector
        self.scale = head_dim ** -0.5

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

    def prepare_step(self, seqs: list[Sequence], num_tokens: list[int], is_prefill: bool,
                     feed_rows: list[int] | None = None) -> StepState:
        step = super().prepare_step(seqs, num_tokens, is_prefill, feed_rows)
        if not is_prefill:
            knobs = self.method_config
            plens = [s.num_prompt_tokens for s in seqs]
            both = to_device(np.array([plens, [knobs.num_kept(n) for n in plens]], dtype=np.int32), self.device,
                             torch.int32)
            step.extras["omnikv_prompt_lens"], step.extras["omnikv_keep"] = both[0], both[1]
        return step

    def graph_extras(self, max_batch_size: int) -> dict[str, torch.Tensor]:
        # Padding rows: a one-token prompt, one token kept.
        return {k: torch.ones(max_batch_size, dtype=torch.int32, device=self.device)
                for k in ("omnikv_prompt_lens", "omnikv_keep")}

    def build_decode_view(self, layer_id: int, q: torch.Tensor, step: StepState) -> DecodeView:
        role, source = self.roles[layer_id]
        if role == "dense":
            return super().build_decode_view(layer_id, q, step)
        controller = get_forward_context().controller
        if role == "filter":
            view = super().build_decode_view(layer_id, q, step)
            if self.selector == "last":
                # The filter layer's own dense attention computes every q . k anyway: it reports the
                # max over heads per token instead of a scoring pass reading the keys again.
                view.token_scores = torch.empty(q.shape[0], self.num_kv_heads,
                                                step.block_tables.shape[1] * self.page_size,
                                                dtype=torch.float32, device=q.device)
                scores = view.token_scores              # [B, H_kv, T]: the max over groups comes below
            else:
                scores = omnikv_scores(q, self.pool.layer(layer_id)[0], step.block_tables, step.cache_lens,
                                       step.extras["omnikv_prompt_lens"], self.page_size, self.scale,
                                       self.selector)
            controller.put(f"omnikv.{layer_id}", scores)
            return view
        # The first sparse layer after a filter layer selects (its scores are complete by now);
        # the others reuse the selection.
        selection = controller.get(f"omnikv.{source}")
        if isinstance(selection, torch.Tensor):
            if selection.dim() == 3:    # the filter attention's per-group maxima: [B, H_kv, T] -> [B, T]
                selection = selection.amax(dim=1)
            selection = combine_shared_scores(selection)   # the max over every rank's heads
            selection = select_tokens(selection, step.extras["omnikv_keep"], step.block_tables, step.cache_lens,
                                      step.extras["omnikv_prompt_lens"], self.page_size)
            controller.put(f"omnikv.{source}", selection)
        table, lengths = selection
        k_cache, v_cache = self.pool.layer(layer_id)
        return DecodeView(k_cache, v_cache, table, lengths, 1)
