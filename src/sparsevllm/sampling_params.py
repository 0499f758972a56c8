"""How one request is decoded, as vLLM users write it. Every field is type-checked on creation, so
a wrong type is a clear error naming the field, not a TypeError deep in the sampler."""
from dataclasses import dataclass, fields

from sparsevllm.config import is_int, is_number


class SamplingParamsError(ValueError):
    """A SamplingParams field with a bad value; `field` names it (the server's error names the
    request field it came from)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class SamplingParams:
    """temperature 0 means greedy; top_k -1 and top_p 1.0 disable those filters.

    n: samples of the prompt (they share its KV pages). stop: strings that end the output (not
    included unless include_stop_str_in_output); stop_token_ids: token ids that end it (included).
    logprobs: the sampled token's log-probability and the top-k alternatives per generated token;
    prompt_logprobs: the same for every prompt token after the first. Penalties follow vLLM / HF:
    repetition_penalty divides positive (multiplies negative) logits of every token seen in the
    prompt or output; presence_penalty subtracts a constant from, and frequency_penalty a multiple
    of the count of, every token already generated. min_tokens: EOS and stop tokens are masked
    until that many tokens are generated.
    """
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        def need(ok: bool, field: str, valid: str):
            if not ok:
                raise SamplingParamsError(field, f"SamplingParams.{field} must be {valid}, "
                                                 f"got {getattr(self, field)!r}")

        need(is_int(self.n) and self.n >= 1, "n", "an integer >= 1")
        need(is_number(self.temperature) and self.temperature >= 0, "temperature", ">= 0 (a number; 0 = greedy)")
        need(is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "a number in (0, 1]")
        need(is_int(self.top_k) and (self.top_k >= 1 or self.top_k == -1), "top_k", "-1 (off) or an integer >= 1")
        need(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1")
        need(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"an integer in [0, max_tokens={self.max_tokens}]")
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        need(stops is None or (isinstance(stops, (list, tuple)) and all(isinstance(s, str) and s for s in stops)),
             "stop", "a non-empty string or a list of them")
        self.stop = list(stops or [])
        need(self.stop_token_ids is None or (isinstance(self.stop_token_ids, (list, tuple))
                                             and all(is_int(t) and t >= 0 for t in self.stop_token_ids)),
             "stop_token_ids", "a list of token ids (integers >= 0)")
        self.stop_token_ids = list(self.stop_token_ids or [])
        need(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output", "a bool")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            need(value is None or (is_int(value) and value >= 0), name, "None or an integer >= 0 (top-k alternatives)")
        need(is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
             "a number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            need(is_number(getattr(self, name)) and -2.0 <= getattr(self, name) <= 2.0, name,
                 "a number in [-2, 2] (0 = off)")
        # torch.Generator.manual_seed's range; beyond it the engine failed while queueing the request
        need(self.seed is None or (is_int(self.seed) and -2**63 <= self.seed < 2**64), "seed",
             "None or an integer in [-2**63, 2**64)")
        need(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "a bool")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def clone(self, **changes) -> "SamplingParams":
        return SamplingParams(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})
