"""Tensor parallelism across processes (issue #17): rank 0 drives, ranks 1..N-1 follow.

Rank 0 is the user's process: it runs the scheduler, samples and owns the requests. Every other
rank is a spawned process holding its slice of the weights and a cache manager over its KV heads
(`Follower`). Rank 0 sends one command per step over the gloo command group (as nano-vllm sends
its `run` call through shared memory): the scheduler's page decisions since the last step, then the
step's requests. A follower replays the page decisions on its own cache manager, with mirrors of
the requests' counters, tokens and resolved sparsity (each request's method and knobs, sent with
it once), so its allocator, block tables and prefix cache take the same
decisions as rank 0's (SnapKV's compaction too, which allocates pages in `on_step_end` from the
same state); then it builds the same step and runs the same forward, whose collectives pair with
rank 0's. Under overlapped scheduling a decode input may still be on rank 0's device: rank 0
broadcasts the step's input ids (one small collective) and followers read them from there.

A follower that fails reports its traceback through a queue and exits; its peers' next collective
fails, and rank 0 raises the follower's error instead of hanging (`Workers.failure`).
"""
import logging
import os
import queue
import signal
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsevllm import distributed as tp
from sparsevllm.config import EngineConfig
from sparsevllm.engine.sequence import Sequence, SequenceStatus
from sparsevllm.method_registry import sparsity_received, sparsity_to_send

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


class Workers:
    """Rank 0's handle on the follower processes."""

    def __init__(self, config: EngineConfig, model_path: str, device_type: str):
        world = config.tensor_parallel_size
        # Refused before any rank is spawned: a follower started for a rank 0 that then cannot join
        # would wait in the rendezvous for 30 minutes (on a GPU holding a CUDA context).
        tp.check_no_process_group()
        ctx = mp.get_context("spawn")
        self.errors = ctx.Queue()
        ready = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=follower_main, daemon=True, name=f"sparsevllm-tp{rank}",
                                  args=(rank, world, port, config, model_path, device_type, self.errors, ready))
                      for rank in range(1, world)]
        self.closed = False
        # True while the followers may be inside collectives that rank 0 has not finished: building
        # their runners (weights, the KV-page agreement, graph capture), then from a step's command
        # until rank 0's on_step_end. A rank 0 that fails there leaves them waiting in a collective,
        # where they never read an "exit" command (broadcasting it blocks rank 0 for good): they are
        # stopped instead. The engine clears it once its own runner is built.
        self.mid_collectives = True
        try:
            for p in self.procs:
                p.start()
            self._await_followers(ready, world)
            if device_type == "cuda":
                torch.cuda.set_device(0)
            tp.init_tensor_parallel(0, world, port, backend_for(device_type))
        except BaseException:
            self._stop_procs()
            raise

    def _await_followers(self, ready, world: int) -> None:
        """Wait until every follower is about to join the group. The rendezvous itself waits for
        every rank (30 minutes) and cannot be interrupted: a follower that dies before it (a script
        without the `__main__` guard fails while its spawned copy bootstraps) would hang rank 0."""
        waiting = set(range(1, world))
        while waiting:
            try:
                waiting.discard(ready.get(timeout=0.1))
            except queue.Empty:
                pass
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead and waiting:
                try:   # a traceback the follower reported itself (one dead while bootstrapping reports none)
                    rank, tb = self.errors.get(timeout=1.0)
                    reason = f"tensor-parallel rank {rank} failed:\n{tb}"
                except queue.Empty:
                    reason = ""
                raise RuntimeError(
                    f"tensor-parallel rank process {dead[0].name} exited before joining (exit code "
                    f"{dead[0].exitcode}; its traceback is on stderr). The ranks are spawned processes that import "
                    f"the main script again: a script must guard its entry point with `if __name__ == \"__main__\":`."
                    + (f"\n{reason}" if reason else ""))

    def _stop_procs(self) -> None:
        for p in self.procs:
            if p.pid is not None and p.is_alive():   # pid None: never started
                p.terminate()
        for p in self.procs:
            if p.pid is not None:
                p.join(timeout=5)

    def send(self, command: tuple) -> None:
        if self.closed:   # else a collective on a destroyed group, reported as a follower's stale error
            raise RuntimeError("this LLM's tensor-parallel ranks were stopped (by LLM.shutdown(), or after a failed "
                               "or interrupted step, which leaves them out of step); create a new LLM")
        tp.broadcast_command(command)

    def query(self, name: str) -> list:
        """Ask every follower for a piece of its state (tests: allocators); a list, rank 1 first."""
        self.send(("query", name))
        return tp.gather_replies(None)[1:]

    def failure(self, timeout: float = 5.0) -> str | None:
        """A follower's error report, if one failed (waits up to timeout for it to arrive)."""
        try:
            rank, tb = self.errors.get(timeout=timeout if any(not p.is_alive() for p in self.procs) else 0.5)
        except queue.Empty:
            dead = [p.name for p in self.procs if not p.is_alive()]
            return f"{', '.join(dead)} exited" if dead else None
        return f"tensor-parallel rank {rank} failed:\n{tb}"

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        told = False
        if not self.mid_collectives and all(p.is_alive() for p in self.procs):
            try:
                tp.broadcast_command(("exit",))   # not send(): it refuses once closed
                told = True
            except Exception:   # the group is broken (a rank failed): the processes are stopped below
                pass
        # Tear the groups down together with the followers, before waiting for them to exit: they are
        # inside the same teardown, which under NCCL waits for every rank (waiting first hung on the H200s).
        tp.destroy_tensor_parallel(abort=not told)
        if told:
            for p in self.procs:
                p.join(timeout=30)
        self._stop_procs()   # not told (out of step, or the group broke): nothing to wait for


def _snapshot(seq: Sequence, sent: dict[int, int]) -> tuple:
    """What a follower needs of a request: its counters and the tokens it has not seen yet; the first
    time, its sampling params and its resolved sparsity (each row decodes with its own method and
    knobs, which the host decisions and the step's views follow)."""
    first = seq.seq_id not in sent
    n = sent.get(seq.seq_id, 0)
    sent[seq.seq_id] = len(seq.token_ids)
    if seq.is_finished:
        sent.pop(seq.seq_id)
    return (seq.seq_id, seq.params if first else None, sparsity_to_send(seq.sparse) if first else None,
            seq.token_ids[n:], seq.num_prompt_tokens,
            seq.num_computed_tokens, seq.cache_len, seq.num_pending_tokens, seq.is_finished)


class CommandedCacheManager:
    """Rank 0's cache manager as the scheduler and the engine see it: the calls that change page
    state are applied here and recorded for the followers, which replay them before the next step."""

    def __init__(self, cache_manager, workers: Workers):
        self._cm, self._workers = cache_manager, workers
        self._ops: list[tuple] = []
        self._sent: dict[int, int] = {}

    def __getattr__(self, name):
        return getattr(self._cm, name)

    def _record(self, op: str, seq: Sequence, *args):
        self._ops.append((op, _snapshot(seq, self._sent), args))

    def allocate(self, seq):
        self._record("allocate", seq)
        return self._cm.allocate(seq)

    def reserve(self, seq, num_new_tokens):
        self._record("reserve", seq, num_new_tokens)
        return self._cm.reserve(seq, num_new_tokens)

    def free(self, seq):
        self._record("free", seq)
        return self._cm.free(seq)

    def commit(self, seq, num_new_tokens):
        self._record("commit", seq, num_new_tokens)
        return self._cm.commit(seq, num_new_tokens)

    def compact_under_pressure(self, seq, capacity):
        # Recorded before it runs: the follower's mirror must see the raw cache_len it compacts from.
        self._record("compact_under_pressure", seq, capacity)
        return self._cm.compact_under_pressure(seq, capacity)

    def _flush(self) -> list[tuple]:
        ops, self._ops = self._ops, []
        return ops

    def send_step(self, seqs, num_tokens, is_prefill, fed: bool) -> None:
        """Before rank 0 builds a step: the followers replay the page decisions since the last one,
        then build and run the same step (fed: its input ids come from rank 0's broadcast)."""
        snaps = [_snapshot(s, self._sent) for s in seqs]
        self._workers.mid_collectives = True   # the followers run this step's collectives until on_step_end
        self._workers.send(("step", self._flush(), snaps, list(num_tokens), is_prefill, fed))

    def on_step_end(self, step):
        out = self._cm.on_step_end(step)
        self._workers.mid_collectives = False   # rank 0 went through the whole step: the ranks are in step
        return out

    def sync(self) -> None:
        """Send the page decisions not yet sent (requests freed after the last step)."""
        self._workers.send(("ops", self._flush()))


class Follower:
    """A rank > 0: mirrors of the requests, the rank's model runner, and the command loop."""

    def __init__(self, config: EngineConfig, runner, cache_manager):
        self.config, self.runner, self.cm = config, runner, cache_manager
        self.seqs: dict[int, Sequence] = {}

    def _mirror(self, snap: tuple) -> Sequence:
        seq_id, params, sparse, new_tokens, num_prompt, computed, cache_len, pending, finished = snap
        seq = self.seqs.get(seq_id)
        if seq is None:
            seq = self.seqs[seq_id] = Sequence(new_tokens, params)
            seq.seq_id = seq_id
            # Rebuilt by the same resolution as rank 0's; later changes (a compaction under
            # pressure) the follower makes itself when it replays them.
            seq.sparse = sparsity_received(self.config, sparse, num_prompt)
        else:
            seq.token_ids.extend(new_tokens)
        seq.num_prompt_tokens, seq.num_computed_tokens, seq.cache_len = num_prompt, computed, cache_len
        seq.num_pending_tokens = pending
        seq.status = SequenceStatus.FINISHED if finished else SequenceStatus.RUNNING
        return seq

    def _replay(self, ops: list[tuple]) -> None:
        for op, snap, args in ops:
            seq = self._mirror(snap)
            getattr(self.cm, op)(seq, *args)
            if seq.is_finished:
                self.seqs.pop(seq.seq_id, None)

    def _step(self, ops, snaps, num_tokens, is_prefill, fed) -> None:
        self._replay(ops)
        seqs = [self._mirror(s) for s in snaps]
        step = self.runner.prepare_step(seqs, num_tokens, is_prefill)
        if fed:
            dist.broadcast(step.input_ids, src=0)
        self.runner.forward(step)
        self.cm.on_step_end(step)

    def query_allocator(self) -> dict:
        a = self.cm.allocator
        return {"idle": a.is_idle(), "num_free": a.num_free, "num_pages": a.num_pages,
                "tables": len(self.cm.tables.tables), "mirrors": len(self.seqs)}

    def query_accounting(self) -> dict:
        return self.cm.memory_accounting()

    def loop(self) -> None:
        while True:
            command = tp.broadcast_command()
            kind, args = command[0], command[1:]
            if kind == "exit":
                return
            if kind == "step":
                self._step(*args)
            elif kind == "ops":
                self._replay(*args)
            elif kind == "query":
                tp.gather_replies(getattr(self, f"query_{args[0]}")())
            else:
                raise RuntimeError(f"unknown tensor-parallel command {kind!r}")


def _die_with_parent() -> None:
    """Linux: the kernel kills this follower when the thread of rank 0 that started it ends (its process
    killed, say: a benchmark case killed on its timeout left a follower holding its GPU's memory, and
    the next case found none). So build a tensor-parallel LLM in a thread that outlives it."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass   # not Linux: a follower blocked on a dead rank 0 ends at its collective's timeout


def follower_main(rank: int, world: int, port: int, config: EngineConfig, model_path: str, device_type: str,
                  errors, ready) -> None:
    try:
        _die_with_parent()
        from sparsevllm.engine.model_runner import ModelRunner, make_cache_manager
        from sparsevllm.models.config import ModelConfig, read_config_json
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        ready.put(rank)   # rank 0 enters the rendezvous only once every follower got this far
        tp.init_tensor_parallel(rank, world, port, backend_for(device_type))
        model_cfg = ModelConfig.from_dict(read_config_json(model_path))
        runner = ModelRunner(config, model_path, model_cfg)
        Follower(config, runner, make_cache_manager(config, model_cfg, runner)).loop()
        runner.release_graphs()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        errors.close()
        errors.join_thread()
        os._exit(1)   # closes this rank's sockets: the peers' pending collectives fail instead of waiting
    tp.destroy_tensor_parallel()
