"""Fidelity task: teacher-forced decoding after a long natural-text prefix, compared with vanilla.

The prefix is `length` tokens of CPython's bundled documentation and the continuation is the
next `num_tokens` tokens of the same text. Every method is fed the same continuation through its
real decode path (`LLM.teacher_forced_logprobs`), so its next-token distributions can be compared
row by row with vanilla's: top-1 agreement (argmax equal) and KL(vanilla || method), averaged over
the continuation. Unlike the retrieval tasks this sees every change a method makes to the output
distribution, not only the ones that flip an answer.
"""
from typing import TYPE_CHECKING

from sparsevllm.regression.prompts import Sample
from sparsevllm.regression.tasks import sample_rng
from sparsevllm.regression.text import pydoc_text

if TYPE_CHECKING:
    import torch

FIDELITY_TOKENS = 32
# log-probs below this are clamped before the KL so a method that assigns exactly zero
# probability to a token vanilla allows reports a large, finite divergence instead of inf.
MIN_LOGPROB = -100.0

_streams = {}


def _token_stream(tokenizer) -> list[int]:
    key = id(tokenizer)
    if key not in _streams:
        # verbose=False: the whole text is far longer than model_max_length, which is expected.
        _streams[key] = tokenizer(pydoc_text(), add_special_tokens=False,
                                  verbose=False)["input_ids"]
    return _streams[key]


def fidelity_sample(tokenizer, length: int, index: int, seed: int, *, name: str = "fidelity",
                    num_tokens: int = FIDELITY_TOKENS) -> Sample:
    """A raw-text prompt of exactly `length` tokens (the tokenizer's BOS included, no chat
    template: this is language modelling, not a question) and the `num_tokens` that follow it."""
    special = tokenizer("", add_special_tokens=True)["input_ids"]
    stream = _token_stream(tokenizer)
    body = length - len(special)
    if body < 1:
        raise ValueError(f"fidelity length must exceed {len(special)} tokens, got {length}")
    if body + num_tokens > len(stream):  # beyond ~110K tokens: cycle the text
        stream = stream * ((body + num_tokens) // len(stream) + 2)
    rng = sample_rng(seed, name, length, index)
    start = rng.randrange(len(stream) - body - num_tokens + 1)
    prompt_ids = special + stream[start:start + body]
    continuation = stream[start + body:start + body + num_tokens]
    return Sample(task=name, length=length, index=index,
                  prompt=tokenizer.decode(prompt_ids[-64:]), prompt_token_ids=prompt_ids,
                  answers=[tokenizer.decode(continuation)], metric="fidelity",
                  max_tokens=num_tokens, continuation_ids=continuation,
                  meta={"start_token": start, "prompt_tokens": len(prompt_ids)})


def compare(reference: "torch.Tensor", logprobs: "torch.Tensor", continuation: list[int]) -> dict:
    """Row-wise comparison of a method's log-probs [n, vocab] with vanilla's.

    Returns top-1 agreement with vanilla, mean KL(vanilla || method) in nats, and the method's
    own top-1 accuracy on the real text (a sanity figure: vanilla's shows what the model can do).
    """
    import torch   # here, not at the top: the harness's --help imports this module
    import torch.nn.functional as F
    if reference.shape != logprobs.shape:
        raise ValueError(f"log-prob shapes differ: vanilla {tuple(reference.shape)}, "
                         f"method {tuple(logprobs.shape)}")
    # Renormalize both: float16 storage (vanilla) and float32 log-softmax over a large vocabulary
    # (both) leave log-sum-exp ~1e-5 off zero, which would otherwise show up as KL.
    ref = reference.float()
    ref = ref - ref.logsumexp(-1, keepdim=True)
    test = logprobs.float()
    test = (test - test.logsumexp(-1, keepdim=True)).clamp_min(MIN_LOGPROB)
    kl = F.kl_div(test, ref, log_target=True, reduction="none").sum(-1)
    target = torch.tensor(continuation, dtype=torch.long)
    return {
        "top1_agreement": (ref.argmax(-1) == test.argmax(-1)).float().mean().item(),
        "kl": kl.mean().item(),
        "text_top1": (test.argmax(-1) == target).float().mean().item(),
    }
