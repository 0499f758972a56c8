"""Samples, prompt rendering and exact length targeting with the model's tokenizer."""

import hashlib
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Sample:
    """One prompt of one task cell, with everything the grader needs."""
    task: str
    length: int                  # the cell's target prompt length in tokens
    index: int
    prompt: str                  # the final rendered text (template and answer prefix included)
    prompt_token_ids: list[int]  # what the engine receives; len() is the measured length
    answers: list[str]           # references; the metric decides how they are matched
    metric: str
    max_tokens: int
    meta: dict = field(default_factory=dict)
    continuation_ids: list[int] | None = None  # fidelity: the teacher-forced tokens

    @property
    def prompt_hash(self) -> str:
        h = hashlib.sha1(",".join(map(str, self.prompt_token_ids)).encode())
        if self.continuation_ids is not None:
            h.update(b"|" + ",".join(map(str, self.continuation_ids)).encode())
        return h.hexdigest()[:16]


class PromptFormatter:
    """Renders a task body into token ids the way the protocol says.

    With a chat template the body is the single user turn, the template's generation prompt is
    added, and the answer prefix opens the assistant turn (RULER's practice: it tells a small model
    what form the answer takes). Without one, the body and answer prefix are plain text after the
    tokenizer's own special tokens (BOS).
    """

    def __init__(self, tokenizer, use_chat_template: bool = True):
        self.tokenizer = tokenizer
        self.use_chat_template = bool(use_chat_template and getattr(tokenizer, "chat_template", None))

    def render(self, body: str, answer_prefix: str) -> str:
        if self.use_chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True)
            return text + answer_prefix
        return body + "\n\n" + answer_prefix

    def encode(self, text: str) -> list[int]:
        # A rendered chat template already holds its special tokens; adding them again would
        # double the BOS of Llama-3-style templates.
        return self.tokenizer(text, add_special_tokens=not self.use_chat_template)["input_ids"]


def fit_to_length(build: Callable[[int], tuple[str, str]], unit_tokens: list[int],
                  formatter: PromptFormatter, target: int) -> tuple[str, list[int], int]:
    """Pick the number of filler units n so the final prompt is as long as possible but at most
    `target` tokens, measured by tokenizing the real prompt.

    `build(n)` returns (body, answer_prefix) with n filler units; `unit_tokens[i]` is the token count
    of unit i on its own, used only to guess n (tokens merge across boundaries, so the guess is
    corrected by measuring). Returns (prompt text, token ids, n); n == len(unit_tokens) when even
    all units fit.
    """
    cache = {}

    def measure(n):
        if n not in cache:
            text = formatter.render(*build(n))
            cache[n] = (text, formatter.encode(text))
        return len(cache[n][1])

    base = measure(0)
    if base > target:
        raise ValueError(f"length {target} is shorter than the task's prompt without filler "
                         f"({base} tokens); use a larger --lengths value")
    cum = [0]
    for t in unit_tokens:
        cum.append(cum[-1] + t)

    def guess(budget):  # largest n whose estimated length fits `budget`
        lo, hi = 0, len(unit_tokens)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cum[mid] <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    n = guess(target - base)
    if n == len(unit_tokens) and measure(n) <= target:
        return (*cache[n], n)  # everything fits (a short dataset context)
    # Correct the additive estimate by the measured offset, then walk to the exact boundary.
    n = guess(max(0, target - base - (measure(n) - base - cum[n])))
    while n > 0 and measure(n) > target:
        n -= 1
    while n + 1 < len(unit_tokens) and measure(n + 1) <= target:
        n += 1
    text, ids = cache[n]
    return text, ids, n
