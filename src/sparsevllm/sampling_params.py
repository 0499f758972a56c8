from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How one request is decoded. temperature 0 means greedy; top_k -1 and top_p 1.0 disable those filters."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
