"""Attention recall, measured while serving (`recall_sample_every` = N > 0; docs/design.md, section 10).

On every N-th decode step of a request (its decode steps so far, a host counter, divisible by N;
its first decode step is one) the runner marks the request's row on the step (`RecallSample`) and
runs the step eagerly: a CUDA graph holds no measurement, so with N = 0 nothing on the step path
changes. Each attention layer of a marked step attends over its method's view as always, asking
the decode kernel for each query head's log-sum-exp, and once more over the cache manager's
`recall_view`: every token the request holds (None: the layer attends densely already; a row of
length 0: that request does). Per query head,

    recall = exp(lse_view - lse_dense)

is the share of the dense softmax mass that falls on the view's tokens (exact, no probability is
materialised, when the view's tokens are a subset of the dense ones with the same keys; rounding
can push it a hair over 1, so it is clipped there), averaged over the layer's query heads; the
output's relative error is ||o_view - o_dense|| / ||o_dense|| over the layer's heads and channels.
A method that keeps no dense keys at decode time reports what it can define instead, into the same
stats (SnapKV: its compaction's share of the observation window's mass); each method's
`recall_definition` says which.

Per batch row and layer the step holds (recall, error, 1) where measured and zeros elsewhere, on
the device; the marked rows cross to the host beside the step's sampled tokens (no sync on the
step path) and are summed into their request (`RequestRecall`). Under tensor parallelism every
rank measures its own KV heads and rank 0 reports its heads.
"""
import numpy as np
import torch

from sparsevllm.engine.staging import to_device
from sparsevllm.kernels.decode_attention import decode_attention


class RecallSample:
    """One step's measurements: `rows` are the batch rows the host reads back (the sampled decode
    rows; a method measuring at another time, SnapKV at compaction, adds its rows);
    stats [B, num_layers, 3] fp32 = (recall, output relative error, 1) where a layer measured a
    row, zeros elsewhere."""

    def __init__(self, rows: list[int], batch_size: int, num_layers: int, device: torch.device):
        self.rows = rows
        self.stats = torch.zeros(batch_size, num_layers, 3, dtype=torch.float32, device=device)
        # Only the marked rows pay for a dense pass: the others' dense lengths are set to 0.
        marked = set(rows)
        self.marked = to_device([i in marked for i in range(batch_size)], device, torch.bool)

    def record(self, layer_id: int, recall: torch.Tensor, error: torch.Tensor, measured: torch.Tensor) -> None:
        """recall, error, measured: [B] (measured bool): one layer's numbers for every row."""
        row = torch.stack([recall, error, torch.ones_like(recall)], dim=-1)
        self.stats[:, layer_id] = torch.where(measured.view(-1, 1), row, 0.0)

    def to_host(self, seqs: list) -> "HostRecall":
        return HostRecall([seqs[i] for i in self.rows], self.stats[self.rows])


class HostRecall:
    """The marked rows' stats on their way to the host: a pinned copy queued now, read by the
    engine when it reads the step's sampled tokens (`LLMEngine._finish`), which already waited for
    the step."""

    def __init__(self, seqs: list, stats: torch.Tensor):
        self.seqs, self.ready = seqs, None
        if stats.is_cuda:
            self.stats = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            self.stats.copy_(stats, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.stats = stats

    def deliver(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
        for seq, stats in zip(self.seqs, self.stats.numpy()):
            if seq.recall is not None:
                seq.recall.add(stats)


class RequestRecall:
    """One request's sums over its sampled steps: per layer the recall and error summed over the
    samples that measured it, and how many did."""

    def __init__(self, num_layers: int):
        self.sums = np.zeros((num_layers, 3), dtype=np.float64)
        self.samples = 0

    def add(self, stats: np.ndarray) -> None:
        self.sums += stats
        self.samples += 1

    @staticmethod
    def summary(parts: list["RequestRecall"], definition: str) -> dict:
        """metrics["attention_recall"] of a request (its samples `parts`, n > 1 summed): per layer
        the mean over the samples that measured it (None: the layer attended densely on every
        sample, or nothing was sampled); the mean and the error over the measured layers. A request
        sampled but never sparse reports 1.0 and 0.0 (it attended every token); one never sampled
        (no decode step) reports None."""
        sums = sum(p.sums for p in parts)
        samples = sum(p.samples for p in parts)
        counts = sums[:, 2]
        per_layer = [float(r / n) if n else None for r, n in zip(sums[:, 0], counts)]
        errors = [float(e / n) for e, n in zip(sums[:, 1], counts) if n]
        measured = [r for r in per_layer if r is not None]
        if measured:
            mean, error = float(np.mean(measured)), float(np.mean(errors))
        else:
            mean, error = (1.0, 0.0) if samples else (None, None)
        return {"mean": mean, "per_layer": per_layer, "output_rel_error": error, "sampled_steps": samples,
                "definition": definition}


def measured_attention(layer_id: int, q: torch.Tensor, view, scale: float, cache_manager, step) -> torch.Tensor:
    """Decode attention over `view` (the method's), and on a marked step its recall against the
    cache manager's recall_view; returns the view's output, exactly what the unmeasured path gives."""
    B, Hq, _ = q.shape
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    out = decode_attention(q, view.k_cache, view.v_cache, view.table, view.lengths, view.page_size, scale,
                           view.token_scores, view.k_scale, view.v_scale, lse_out=lse)
    dense = cache_manager.recall_view(layer_id, step)
    if dense is None:
        return out
    sample = step.recall
    lengths = dense.lengths * sample.marked.view(B, 1).to(dense.lengths.dtype)
    lse_dense = torch.empty_like(lse)
    out_dense = decode_attention(q, dense.k_cache, dense.v_cache, dense.table, lengths.contiguous(),
                                 dense.page_size, scale, None, dense.k_scale, dense.v_scale, lse_out=lse_dense).float()
    recall = torch.exp(lse - lse_dense).clamp(max=1.0).mean(dim=1)
    error = (out.float() - out_dense).flatten(1).norm(dim=1) / out_dense.flatten(1).norm(dim=1).clamp(min=1e-30)
    sample.record(layer_id, recall, error, (lengths > 0).all(dim=1))
    return out
