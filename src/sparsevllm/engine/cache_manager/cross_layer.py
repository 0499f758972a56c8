"""What the cross-layer methods share (OmniKV, DeltaKV): a few dense "filter" layers score every
token with their own decode attention, and the sparse layers after each attend to what those
scores select, within the same step.

The hand-off goes through the step (`step.scratch`): the filter layer leaves its scores under its
key, the first sparse layer after it replaces them with the selection, the later ones reuse that.
"""
import torch

from sparsevllm.engine.step import DecodeView, StepState


def layer_roles(num_layers: int, filter_layers: list[int], wait: int = 0) -> list[tuple[str, int | None]]:
    """Per layer ("dense", None) | ("filter", None) | ("sparse", the filter layer it follows): the
    layers before the first filter layer and the `wait` layers after each are dense."""
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


def scored_view(view: DecodeView, step: StepState, key: str) -> DecodeView:
    """The filter layer's dense view, with a buffer its attention fills with each token's raw logit
    max over each KV group's query heads ([B, H_kv, table width]; DecodeView.token_scores): the
    scores come out of the attention that reads the keys anyway, instead of a pass reading them
    again. Left in step.scratch[key] for the sparse layers after it."""
    B, _, N = view.table.shape
    view.token_scores = torch.empty(B, view.k_cache.shape[1], N * view.page_size, dtype=torch.float32,
                                    device=view.k_cache.device)
    step.scratch[key] = view.token_scores
    return view


def selection(step: StepState, key: str, select):
    """What the sparse layers after filter layer `key` attend to: `select(scores)` of the scores it
    left, made by the first of them (the scores are complete by then) and reused by the others."""
    chosen = step.scratch[key]
    if isinstance(chosen, torch.Tensor):
        chosen = step.scratch[key] = select(chosen)
    return chosen
