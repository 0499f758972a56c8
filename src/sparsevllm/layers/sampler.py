"""Greedy, temperature, top-k and top-p sampling, batched, with optional per-request seeds.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws from p exactly
and lets each seeded request take its noise from its own generator, so its samples do not depend on
which other requests share the batch. Nothing here waits for the device: per-request parameters
cross in non-blocking copies from pinned memory, so the host can build the next step meanwhile.
"""
import torch

from sparsevllm.engine.staging import to_device
from sparsevllm.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], default_generator: torch.Generator) -> torch.Tensor:
    """logits: [B, V] fp32 -> token ids [B] int64, on logits' device."""
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy
    dev = logits.device
    temps = to_device([p.temperature if not p.greedy else 1.0 for p in params], dev, torch.float32)
    logits = logits / temps.unsqueeze(1)
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        vocab = logits.shape[1]
        ks = to_device([min(k, vocab) if k > 0 else vocab for k in top_k], dev)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(dim=-1) - probs) >= to_device(top_p, dev, torch.float32).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, g in enumerate(generators):
        noise[i].exponential_(generator=g if g is not None else default_generator)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = to_device([p.greedy for p in params], dev, torch.bool)
    return torch.where(is_greedy, greedy, sampled)


def apply_penalties(logits: torch.Tensor, prompt_ids: list[list[int]], output_ids: list[list[int]],
                    pending: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """vLLM's (and HF's) penalties on [S, V] logits. pending: [S] the newest output token of each
    row when it is only on the device (-1: none). repetition_penalty divides the positive logits
    (multiplies the negative ones) of every token in the prompt or the output; frequency_penalty
    subtracts its multiple of a token's output count, presence_penalty a constant once it occurred."""
    S, V = logits.shape
    dev = logits.device

    def counts(lists: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(x) for x in lists))
        ids = to_device([x + [V] * (width - len(x)) for x in lists], dev)     # V: a padding column
        return torch.zeros(S, V + 1, device=dev).scatter_add_(1, ids, torch.ones(ids.shape, device=dev))[:, :V]

    out = counts(output_ids)
    out.scatter_add_(1, pending.clamp(min=0).view(S, 1), (pending >= 0).float().view(S, 1))
    seen = (out > 0) | (counts(prompt_ids) > 0)
    rep = to_device([p.repetition_penalty for p in params], dev, torch.float32).view(S, 1)
    freq = to_device([p.frequency_penalty for p in params], dev, torch.float32).view(S, 1)
    pres = to_device([p.presence_penalty for p in params], dev, torch.float32).view(S, 1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - freq * out - pres * (out > 0).float()
