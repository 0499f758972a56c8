"""The sampling half of a step: logits -> tokens (and the log-probabilities a request asked for),
issued on the device, then carried to pinned host memory for the host to read a step later.

Order per sampled row, as vLLM does it: the raw logits give the reported log-probabilities; the
penalties and the min_tokens mask then shape the logits that are sampled; teacher-forced tokens
replace the sample. Nothing here waits for the device: host lists cross in pinned non-blocking
copies, and a request's newest token, when it is still on the device, is taken from the step's
input ids there (overlapped scheduling).
"""
import torch

from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.staging import to_device
from sparsevllm.engine.step import StepState
from sparsevllm.layers.sampler import apply_penalties, sample


class SampledStep:
    """A launched step's sampled tokens and log-probabilities, on their way to the host."""

    def __init__(self, seqs: list[Sequence], num_tokens: int, device_tokens: torch.Tensor | None = None,
                 extras: dict[str, torch.Tensor] | None = None):
        self.seqs, self.num_tokens, self.device_tokens = seqs, num_tokens, device_tokens
        self.rows = {s.seq_id: j for j, s in enumerate(seqs)}
        self.prompt_rows: list[tuple[Sequence, int, int]] = []   # (request, first position, count)
        self.recall = None   # the step's attention-recall stats on their way to the host (engine/recall.py)
        tensors = dict(extras or {})
        if device_tokens is not None:
            tensors["tokens"] = device_tokens
        self._ready = None
        if device_tokens is not None and device_tokens.is_cuda:
            host = {}
            for key, t in tensors.items():
                host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host[key].copy_(t, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
            tensors = host
        self._host = tensors

    def host(self) -> dict[str, torch.Tensor]:
        """Waits for the copies of this step only (the device may be running the next one)."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._host


def _topk_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int, prefix: str) -> dict[str, torch.Tensor]:
    """The chosen tokens' log-probability and rank, and the top k."""
    picked = logprobs.gather(1, chosen.view(-1, 1)).squeeze(1)
    out = {f"{prefix}_logprob": picked, f"{prefix}_rank": (logprobs > picked.view(-1, 1)).sum(dim=1) + 1}
    if k > 0:
        top = logprobs.topk(k, dim=-1)
        out.update({f"{prefix}_top_values": top.values, f"{prefix}_top_ids": top.indices})
    return out


def sample_step(step: StepState, logits: torch.Tensor, generators: dict[int, torch.Generator],
                default_generator: torch.Generator, eos_ids: set[int]) -> SampledStep:
    """logits: the rows of step.logits_indices, prompt-logprob rows first, then one row per
    sampled request (step.sampled)."""
    seqs = [step.seqs[i] for i in step.sampled]
    if not seqs and not step.prompt_logprob_rows:
        return SampledStep([], sum(step.num_tokens))
    dev = logits.device
    raw = logits[logits.shape[0] - len(seqs):]
    extras: dict[str, torch.Tensor] = {}
    if step.prompt_logprob_rows:
        lp = torch.log_softmax(logits[:logits.shape[0] - len(seqs)], dim=-1)
        targets = [t for i, start, count in step.prompt_logprob_rows
                   for t in step.seqs[i].token_ids[start + 1:start + 1 + count]]
        k = max(step.seqs[i].params.prompt_logprobs for i, _, _ in step.prompt_logprob_rows)
        extras.update(_topk_logprobs(lp, to_device(targets, dev), k, "prompt"))
    if not seqs:
        return SampledStep([], sum(step.num_tokens), None, extras)
    shaped = raw
    penalized = [j for j, s in enumerate(seqs) if s.params.has_penalties]
    if penalized:
        rows = to_device(penalized, dev)
        # The newest output token may still be sampling on the device: it is this step's input.
        input_rows = step.logits_indices[logits.shape[0] - len(seqs):][rows]
        pending = torch.where(to_device([seqs[j].num_pending_tokens > 0 for j in penalized], dev, torch.bool),
                              step.input_ids[input_rows], -1)
        shaped = shaped.clone()
        shaped[rows] = apply_penalties(
            raw[rows], [seqs[j].prompt_token_ids for j in penalized],
            [seqs[j].completion_token_ids for j in penalized], pending, [seqs[j].params for j in penalized])
    # min_tokens: no EOS or stop token before that many tokens exist.
    masked = [(j, t) for j, s in enumerate(seqs) if s.num_generated < s.params.min_tokens
              for t in (set() if s.params.ignore_eos else eos_ids) | set(s.params.stop_token_ids)]
    if masked:
        shaped = shaped.clone() if shaped is raw else shaped
        rows, ids = zip(*masked)
        # the value made on the device: a Python scalar is copied from pageable memory (a sync)
        shaped.index_put_((to_device(rows, dev), to_device(ids, dev)), torch.full((), float("-inf"), dtype=shaped.dtype, device=dev))
    tokens = sample(shaped, [s.params for s in seqs], [generators.get(s.seq_id) for s in seqs], default_generator)
    forced = [(j, s.forced_token_ids[s.num_generated]) for j, s in enumerate(seqs) if s.forced_token_ids is not None]
    if forced:
        rows, ids = zip(*forced)
        tokens[to_device(rows, dev)] = to_device(ids, dev)
    if any(s.full_logprobs is not None or s.output_logprobs is not None for s in seqs):
        lp = torch.log_softmax(raw, dim=-1)
        if any(s.full_logprobs is not None for s in seqs):
            extras["full_logprobs"] = lp
        asked = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        if asked:
            extras.update(_topk_logprobs(lp, tokens, max(asked), "sample"))
    return SampledStep(seqs, sum(step.num_tokens), tokens, extras)


def position_logprobs(host: dict[str, torch.Tensor], prefix: str, row: int, token: int, k: int,
                      decode=None) -> dict:
    """{token id: Logprob} for one position: the chosen token, then the top k."""
    from sparsevllm.outputs import Logprob

    def text(t):
        return decode([t]) if decode is not None else None
    out = {token: Logprob(float(host[f"{prefix}_logprob"][row]), int(host[f"{prefix}_rank"][row]), text(token))}
    if k > 0:
        for rank, (value, tid) in enumerate(zip(host[f"{prefix}_top_values"][row, :k].tolist(),
                                                host[f"{prefix}_top_ids"][row, :k].tolist()), start=1):
            out.setdefault(tid, Logprob(value, rank, text(tid)))
    return out
