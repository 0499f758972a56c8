"""Tensor-parallel state shared by the layers, the engine and the cache managers (issue #17).

One process per rank: the default process group carries the forward's collectives (NCCL on GPUs,
gloo on a CPU), and a second, gloo-only group carries the engine's commands from rank 0 to the
workers (pickled Python objects, which NCCL cannot broadcast cheaply). With tensor_parallel_size = 1
no group exists and `tp_size()` is 1: every layer then takes its plain single-device path.

A selection shared across heads (OmniKV's token set, QuEST `shared` pages) must be the same on every
rank although each rank scores only its own KV heads: ranks combine their scores with one all-reduce
(max for a max over heads, sum for a sum over heads), so every rank attends the same tokens.
"""
import logging
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)
_control: "dist.ProcessGroup | None" = None


def tp_size() -> int:
    return dist.get_world_size() if _control is not None else 1


def tp_rank() -> int:
    return dist.get_rank() if _control is not None else 0


def init_tensor_parallel(rank: int, world: int, port: int, backend: str) -> None:
    """Join the ranks' groups. The command group waits for rank 0 without a deadline: a server may
    sit idle for hours between requests."""
    global _control
    check_no_process_group()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=30))
    _control = dist.new_group(backend="gloo", timeout=timedelta(days=365))


def check_no_process_group() -> None:
    if dist.is_initialized():
        raise ValueError("tensor_parallel_size > 1 needs a process without a torch.distributed group already "
                         "initialised (one tensor-parallel LLM per process at a time; call LLM.shutdown() first)")


TEARDOWN_TIMEOUT_S = 60.0


def destroy_tensor_parallel(abort: bool = False) -> None:
    """Leave the groups. Every rank must call this at about the same time: NCCL's communicator
    teardown waits for its peers, so a rank that first waits for the others to exit never returns.
    abort: a peer is gone (it failed), so NCCL's communicators are aborted instead of torn down with
    it. The teardown runs under a deadline: one that cannot finish must not hang the user's process."""
    global _control
    if _control is None:
        return
    _control = None
    nccl = dist.get_backend() == "nccl"

    def teardown():
        if abort and nccl:
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()

    t = threading.Thread(target=teardown, name="sparsevllm-tp-teardown", daemon=True)
    t.start()
    t.join(TEARDOWN_TIMEOUT_S)
    if t.is_alive():
        logger.error("tensor-parallel teardown did not finish in %.0f s (a peer never joined it); "
                     "continuing without it", TEARDOWN_TIMEOUT_S)


def broadcast_command(obj=None):
    """Rank 0 sends obj to every rank; every rank returns it."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_control)
    return box[0]


def gather_replies(obj) -> list | None:
    """Every rank's obj, on rank 0 (None elsewhere)."""
    out = [None] * tp_size() if tp_rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=_control)
    return out


def agree_min(value: int) -> int:
    """The smallest of the ranks' values (KV pages: every rank must hold the same page count)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_control)
    return int(t.item())


def combine_shared_scores(scores: torch.Tensor, op: str = "max") -> torch.Tensor:
    """The max (or sum) over ranks of per-rank scores already reduced over the rank's heads."""
    if tp_size() > 1:
        scores = scores.contiguous()   # collectives need dense memory (a no-op when it already is)
        dist.all_reduce(scores, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return scores


def check_kv_heads(num_kv_heads: int, num_heads: int, tensor_parallel_size: int) -> None:
    """Raise before any weights load: each rank owns whole KV heads (and their query groups)."""
    if num_kv_heads % tensor_parallel_size or num_heads % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must divide the model's KV heads "
                         f"({num_kv_heads}) and attention heads ({num_heads}); each rank owns whole KV heads")
