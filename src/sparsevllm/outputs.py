"""What `LLM.generate` returns, shaped like vLLM's RequestOutput / CompletionOutput.

The dict keys of the earlier API (`out["text"]`, `out["token_ids"]`, `out["prompt_token_ids"]`,
`out["finish_reason"]`, `out["error"]`, `out["metrics"]`) still read, with a DeprecationWarning, for
one release; they name the first completion.
"""
import warnings
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int                        # 1 = the most likely token
    decoded_token: str | None = None


# per position: {token id: Logprob} holding the chosen token and the top-k alternatives
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None        # "stop" | "length" | "error"
    stop_reason: int | str | None = None   # the stop token id or stop string that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    metrics: dict = field(default_factory=dict)

    _LEGACY = ("text", "token_ids", "prompt_token_ids", "finish_reason", "error", "metrics")

    def _legacy(self, key: str):
        first = self.outputs[0]
        return {"text": first.text, "token_ids": first.token_ids, "prompt_token_ids": self.prompt_token_ids,
                "finish_reason": first.finish_reason, "error": self.error, "metrics": self.metrics}[key]

    def __getitem__(self, key: str):
        if key not in self._LEGACY:
            raise KeyError(key)
        warnings.warn(f"RequestOutput[{key!r}] is deprecated; use attributes (out.outputs[0].text, "
                      "out.prompt_token_ids, ...)", DeprecationWarning, stacklevel=2)
        return self._legacy(key)

    def get(self, key: str, default=None):
        return self[key] if key in self._LEGACY else default

    def keys(self):
        return list(self._LEGACY)
