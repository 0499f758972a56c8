"""Continuous batching with chunked prefill, admission through the cache manager and preemption by
recompute (under vllm_sparse_method="auto", a decode step short of pages first compacts a running
request instead: cache_manager/pressure.py). A step is either a prefill step (chunks of one or more
prompts) or a decode step (one token for every running request). The scheduler never reads KV; it
asks the cache manager."""
import logging
from collections import deque
from dataclasses import dataclass

from sparsevllm.config import EngineConfig
from sparsevllm.engine.cache_manager import pressure
from sparsevllm.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]
    is_prefill: bool


class Scheduler:
    def __init__(self, config: EngineConfig, cache_manager):
        self.config = config
        self.cm = cache_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_pressure_compactions = 0   # preemptions avoided by compacting a request ("auto")

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule_prefill()
        if batch.seqs:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch:
        cfg, budget = self.config, self.config.max_num_batched_tokens
        seqs, num_tokens = [], []

        def take(seq: Sequence) -> bool:
            nonlocal budget
            n = self.cm.chunk_size(seq, min(cfg.chunk_prefill_size, budget))
            if n <= 0 or not self.cm.reserve(seq, n):
                return False
            seqs.append(seq)
            num_tokens.append(n)
            budget -= n
            return True

        # Requests part-way through their prompt go first, in admission order.
        for seq in list(self.running):
            if budget <= 0:
                break
            if not seq.in_prefill:
                continue
            if self.cm.chunk_size(seq, min(cfg.chunk_prefill_size, budget)) <= 0:
                continue  # the method needs a larger chunk than this step has left: wait a step
            if not take(seq):
                # Another request's growth took the pages this prompt was admitted with: recompute it
                # later, and go on: its freed pages may let the next prompt run (stopping here could
                # leave a step with nothing to run, and the engine would fail a request that fits).
                self.preempt(seq)
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending_tokens or self._waits_for_parent(seq) or not self.cm.can_admit(seq):
                break  # (a request preempted while its last token was sampling waits for that token)
            self.cm.allocate(seq)
            if seq.num_uncomputed_tokens == 0:
                break
            if not take(seq):
                self.cm.free(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return ScheduledBatch(seqs, num_tokens, True)

    @staticmethod
    def _waits_for_parent(seq: Sequence) -> bool:
        """A request's other samples start once its first has prefilled the prompt, so they find
        the prompt's pages in the prefix cache instead of computing them again."""
        parent = seq.prefix_parent
        return parent is not None and not parent.is_finished and parent.num_computed_tokens < parent.num_prompt_tokens

    def _reaches_length(self, seq: Sequence) -> bool:
        """Every token the request may produce is already sampled (overlapped scheduling: some are
        still on the device); it finishes by length when they arrive, so it needs no more steps."""
        return len(seq) - seq.num_prompt_tokens >= seq.params.max_tokens or len(seq) >= self.config.max_model_len

    def _schedule_decode(self) -> ScheduledBatch:
        scheduled = []
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING or seq.in_prefill or self._reaches_length(seq):
                continue  # preempted below while making room for an earlier request, still prefilling, or done
            while not self.cm.reserve(seq, 1):
                if self._compact_for_pages(scheduled):
                    continue
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(seq)
        return ScheduledBatch(scheduled, [1] * len(scheduled), False)

    def _compact_for_pages(self, scheduled: list[Sequence]) -> bool:
        """"auto" under memory pressure: compact the running request whose compaction frees the most
        pages (cache_manager/pressure.py) instead of preempting one; False when no request can free
        any (then preemption, as before)."""
        if not self.config.compacts_under_pressure:
            return False
        capacity = self.config.auto_compact_capacity
        victim = pressure.compact_victim(self.cm, self.running, capacity)
        if victim is None:
            return False
        self.cm.compact_under_pressure(victim, capacity)
        self.num_pressure_compactions += 1
        if victim in scheduled:   # its reserved slot went with its old pages; the compaction freed a page
            taken = self.cm.reserve(victim, 1)
            assert taken
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a request's KV and send it back to the front of the queue; it will be recomputed
        from its tokens (prompt + what it generated so far) by prefill. With dense attention its
        output does not change; a method whose decode attention reads a sparse view recomputes the
        generated tokens' KV through its prefill path instead, so the continuation can differ
        (each method's module says whether it does)."""
        logger.info("preempting request %d (out of KV pages)", seq.seq_id)
        self.num_preemptions += 1
        self.running.remove(seq)
        self.cm.free(seq)
        seq.num_computed_tokens = seq.cache_len = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Also for a request preempted while its last token was still sampling (it waits)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cm.free(seq)
