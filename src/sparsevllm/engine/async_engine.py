"""AsyncLLM: the engine for a server. One thread runs the engine loop; asyncio callers submit
requests and read their tokens as the steps produce them.

Requests join the running batch at the next step (continuous batching: nobody waits for a batch to
end). After every step the loop hands each live request the tokens the host learned for it; a
request that is aborted (its client went away) is finished at once and its KV pages are freed. An
exception while a step runs fails the requests of that step, frees their pages and leaves the others
running; an exception while one request's output is built fails that request alone.
"""
import asyncio
import bisect
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from sparsevllm.engine.llm_engine import LLMEngine
from sparsevllm.engine.sequence import Sequence
from sparsevllm.outputs import RequestOutput
from sparsevllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Attention recall (a share) and the output's relative error, per finished request (recall_sample_every).
RECALL_BUCKETS = (0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)
ERROR_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class Histogram:
    """Cumulative bucket counts, a sum and a count: constant memory however long the server runs."""

    def __init__(self, bounds=LATENCY_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * len(bounds)   # observations <= bounds[i]
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i in range(bisect.bisect_left(self.bounds, value), len(self.bounds)):
            self.counts[i] += 1


@dataclass
class Stats:
    """What /metrics reports, updated by the engine thread."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    started: float = field(default_factory=time.time)
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    recall: Histogram = field(default_factory=lambda: Histogram(RECALL_BUCKETS))
    recall_error: Histogram = field(default_factory=lambda: Histogram(ERROR_BUCKETS))


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()
        self.seq: Sequence | None = None
        self.sent = 0

    def push(self, item) -> None:
        _call_soon(self.loop, self.queue.put_nowait, item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, arg) -> bool:
    """Schedule fn(arg) on a client's event loop from the engine thread. A loop that is closed (its
    client finished with asyncio.run while the engine was busy) reads nothing any more: False, and
    the engine thread carries on instead of dying for every other request."""
    try:
        loop.call_soon_threadsafe(fn, arg)
        return True
    except RuntimeError:
        return False


def _deliver(batch: list) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.stats = Stats()
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._streams: dict[int, _Stream] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="sparsevllm-engine", daemon=True)
        self._thread.start()

    # ---- asyncio side ---------------------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams, sparse=None):
        """Yields RequestOutput snapshots as tokens arrive; the last one has finished=True. Closing
        the generator (a client that disconnected) aborts the request and frees its pages."""
        stream = _Stream(asyncio.get_running_loop())
        # Stamped here, not when the engine thread takes it: TTFT then counts the wait for a step.
        self._inbox.put(("add", prompt, params, sparse, stream, time.perf_counter()))
        self._wake.set()
        done = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                yield item
                if item.finished:
                    done = True
                    return
        finally:
            # Closed early: abort, also when the engine thread has not taken the request yet (the
            # inbox is in order, so the abort finds it added); the engine thread checks whether any
            # sample still runs (the first may have finished while the others run on).
            if not done:
                self._inbox.put(("abort", stream))
                self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ---- engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        while not self._stop:
            self._drain_inbox()
            self._publish()   # requests refused at admission finish without a step
            if not eng.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            running = list(eng.scheduler.running)
            try:
                eng.step()
            except Exception as e:  # noqa: BLE001 - a failing step fails its requests, not the server
                logger.exception("engine step failed; failing the requests it ran")
                self._fail(running, f"internal error: {type(e).__name__}: {e}")
            self._publish()

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                _, prompt, params, sparse, stream, received = item
                try:
                    seq = self.engine.add_request(prompt, params, arrival_time=received, sparse=sparse)
                except (ValueError, TypeError) as e:   # the client's mistake: its own error
                    stream.push(e)
                    continue
                except Exception as e:  # noqa: BLE001 - fails this request, not the engine thread
                    logger.exception("adding a request failed")
                    stream.push(RuntimeError(f"internal error: {type(e).__name__}: {e}"))
                    continue
                stream.seq = seq
                self.stats.prompt_tokens += seq.num_prompt_tokens
                self._streams[seq.seq_id] = stream
            else:
                stream = item[1]
                if stream.seq is not None:   # None: refused at admission, nothing runs
                    self.engine.abort(stream.seq)   # finishes the samples still running
                    # Nobody reads this stream any more, and its event loop may be closed already
                    # (publishing to it would then raise in this thread and stop the engine).
                    self._streams.pop(stream.seq.seq_id, None)

    def _fail(self, seqs: list[Sequence], message: str) -> None:
        for seq in seqs:
            if not seq.is_finished:
                self.engine.fail(seq, message)
        self.engine.reset_in_flight()

    def _publish(self) -> None:
        # One cross-thread wake-up per event loop a step, not one per request and step.
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for seq_id, stream in list(self._streams.items()):
            seq = stream.seq
            try:
                new = seq.num_completion_tokens - stream.sent
                finished = all(s.is_finished for s in seq.group)
                if new <= 0 and not finished:
                    continue
                if stream.sent == 0 and new > 0 and seq.first_token_time is not None:
                    self.stats.ttft.observe(seq.first_token_time - seq.arrival_time)
                # inter-token latencies of the tokens learned since the last publication
                times = seq.token_times[max(0, stream.sent - 1):]
                for a, b in zip(times, times[1:]):
                    self.stats.itl.observe(b - a)
                self.stats.generation_tokens += max(new, 0)
                stream.sent = seq.num_completion_tokens
                out: RequestOutput = self.engine.output(seq)
            except Exception as e:  # noqa: BLE001 - one request's output failing fails it alone
                logger.exception("building the output of request %d failed", seq_id)
                self._fail(seq.group, f"internal error: {type(e).__name__}: {e}")
                stream.push(RuntimeError(seq.error))
                del self._streams[seq_id]
                continue
            batches.setdefault(stream.loop, []).append((stream, out))
            if finished:
                self.stats.requests_finished += 1
                recall = out.metrics.get("attention_recall")
                if recall and recall["mean"] is not None:
                    self.stats.recall.observe(recall["mean"])
                    self.stats.recall_error.observe(recall["output_rel_error"])
                del self._streams[seq_id]
        for loop, batch in batches.items():
            if not _call_soon(loop, _deliver, batch):   # nobody reads these streams any more
                for stream, _ in batch:
                    if stream.seq.seq_id in self._streams:
                        self.engine.abort(stream.seq)
                        del self._streams[stream.seq.seq_id]
