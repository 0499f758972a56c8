"""One request's state. It knows tokens and counters, never pages (the cache manager owns those)."""
import itertools
from enum import Enum, auto

from sparsevllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = itertools.count()

    def __init__(self, token_ids: list[int], params: SamplingParams, arrival_time: float = 0.0,
                 prompt: str | None = None):
        self.seq_id = next(Sequence._ids)
        self.prompt = prompt
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.prompt_token_ids = self.token_ids[:]   # never changes; outputs share it instead of slicing
        self.params = params
        # Tokens whose K/V have been computed: the RoPE position of the next input token. It is the
        # logical length and never shrinks except when the request is preempted (recomputed).
        self.num_computed_tokens = 0
        # Tokens whose K/V are stored for this request. Equal to the logical length unless the method
        # evicts (SnapKV); the cache manager moves it.
        self.cache_len = 0
        # Tokens sampled on the device whose ids the host does not know yet (overlapped
        # scheduling: 0 or 1). They count in len(seq), not in token_ids.
        self.num_pending_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.recall = None   # RequestRecall (engine/recall.py) when recall_sample_every > 0
        # What it decodes with (sparse_params.RequestSparsity: a dense row, or the engine's method
        # with this request's knobs), set when it arrives; None: the engine's method and knobs.
        self.sparse = None
        # The n samples of one request: the first is the request itself and prefills the prompt;
        # the others wait for it (prefix_parent) and then share its prompt pages.
        self.group: list[Sequence] = [self]
        self.prefix_parent: Sequence | None = None
        # What the output reports: per generated token the chosen token's and the top-k
        # log-probabilities (params.logprobs), per prompt token the same (params.prompt_logprobs),
        # and why it stopped (a stop token id or stop string; the text cut before a stop string).
        self.output_logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[dict | None] | None = [None] if params.prompt_logprobs is not None else None
        self.stop_reason: int | str | None = None
        self.output_text: str | None = None
        # Teacher forcing (fidelity measurements): tokens fed instead of sampled ones, and the full
        # log-probability rows collected at each step.
        self.forced_token_ids: list[int] | None = None
        self.full_logprobs: list | None = None

    def __len__(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_completion_tokens(self) -> int:
        """Generated tokens the host knows."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        # More than one token waits for its K/V, or a prompt token does: the request is (re)filling
        # its prompt. A prompt's last token alone in its chunk is prefill too: sparse methods prefill
        # densely (and SnapKV compacts, HiSparse backs the prompt up to host) only in prefill steps.
        return self.num_uncomputed_tokens > 1 or self.num_computed_tokens < self.num_prompt_tokens

    @property
    def num_generated(self) -> int:
        """Generated tokens, those still sampling on the device included."""
        return len(self) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int, pending: bool = False) -> None:
        """A token learned by the host; pending: it was counted as sampling until now."""
        self.token_ids.append(token_id)
        if pending:
            self.num_pending_tokens -= 1
