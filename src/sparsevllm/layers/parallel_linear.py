"""Tensor-parallel linear layers, vocab-parallel embedding and LM head (issue #17).

Each rank holds only its slice of a weight; `weight_loader(param, full_or_part, shard_id)` copies that
slice out of a checkpoint tensor so a rank never materialises another rank's weights on its device.
With tp_size == 1 every class is a plain linear (no communication), so TP=1 stays the same code path.
Column-parallel: output features split, no communication. Row-parallel: input features split, one
all-reduce of the partial sums (the only collective of an attention block or an MLP).
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sparsevllm.distributed import tp_rank, tp_size
from sparsevllm.kernels.skinny_gemm import linear, linear_rope_store, linear_silu_mul, skinny_add_norm_triton, takes


# SPARSEVLLM_FUSED_NORM=0 keeps the norms as their own launches (to measure what the fusion brings).
FUSED_NORM = os.environ.get("SPARSEVLLM_FUSED_NORM", "1") != "0"


def check_shape(loaded, expected) -> None:
    """A checkpoint tensor of another shape than config.json implies is refused, as Hugging Face
    does: narrowing a larger one would silently load its first rows or columns as the model."""
    shape = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())
    if shape != tuple(expected):
        raise ValueError(f"checkpoint shape {shape} does not match config.json (expects {tuple(expected)})")


def narrow(loaded, dim: int, start: int, n: int, full_size: int, param: torch.Tensor) -> torch.Tensor:
    """`loaded.narrow` for a tensor or a safetensors slice (f.get_slice(name)): on a slice only the
    rank's rows/columns are read from the file, never the whole checkpoint tensor. The checkpoint
    tensor must be `param`'s shape but full_size (all ranks' n) along dim."""
    check_shape(loaded, param.shape[:dim] + (full_size,) + param.shape[dim + 1:])
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, n)
    return loaded[start:start + n] if dim == 0 else loaded[:, start:start + n]


def full(loaded, param: torch.Tensor) -> torch.Tensor:
    check_shape(loaded, param.shape)
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def tp_rank_size() -> tuple[int, int]:
    return tp_rank(), tp_size()


class ColumnParallelLinear(nn.Module):
    """y[:, rank's columns] = x @ W[rank's rows].T; output stays sharded (feeds attention or the act)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_size()
        assert out_features % self.tp_size == 0, (out_features, self.tp_size)
        self.weight = nn.Parameter(torch.empty(out_features // self.tp_size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // self.tp_size)) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        n = param.shape[0]
        param.data.copy_(narrow(loaded, 0, self.tp_rank * n, n, n * self.tp_size, param))

    def forward(self, x, row_norm=None):
        """row_norm: x came from RowParallelLinear.add_norm's fused path (rows still to scale by 1 / rms)."""
        return linear(x, self.weight, self.bias, row_norm)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate_up: each of the `sizes` blocks is split by columns; the rank keeps [gate_r | up_r]."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool = False):
        self.sizes = sizes
        super().__init__(in_features, sum(sizes), bias)

    def weight_loader(self, param, loaded, shard_id: int):
        n = self.sizes[shard_id] // self.tp_size
        off = sum(self.sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, off, n).copy_(narrow(loaded, 0, self.tp_rank * n, n, self.sizes[shard_id], param))

    def silu_mul(self, x, row_norm=None):
        """SiLU(gate) * up of this projection ([gate_r | up_r] on every rank), fused on decode steps."""
        assert self.bias is None and len(self.sizes) == 2 and self.sizes[0] == self.sizes[1]
        return linear_silu_mul(x, self.weight, row_norm)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v split by heads: rank r keeps query heads and KV heads [r*h/tp, (r+1)*h/tp).
    KV heads must divide by tp_size (checked by the engine before weights load)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        _, tp = tp_rank_size()
        assert num_heads % tp == 0 and num_kv_heads % tp == 0, (num_heads, num_kv_heads, tp)
        self.q_size = num_heads // tp * head_dim
        self.kv_size = num_kv_heads // tp * head_dim
        super().__init__(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def rope_store(self, x, row_norm, target, cos_sin_cache: torch.Tensor, head_dim: int) -> torch.Tensor | None:
        """This rank's qkv with q and k after RoPE, k and v already written where `target` (a
        StoreTarget) says, in the GEMM's launch; None where the fused kernel does not take the step
        (then project and store separately)."""
        return linear_rope_store(x, self.weight, self.bias, row_norm, self.q_size, self.kv_size, head_dim,
                                 target.positions, cos_sin_cache, target.k_cache, target.v_cache,
                                 target.slot_mapping, target.page_min, target.page_max, target.page_size)

    def weight_loader(self, param, loaded, shard_id: int):
        n = (self.q_size, self.kv_size, self.kv_size)[shard_id]
        off = (0, self.q_size, self.q_size + self.kv_size)[shard_id]
        param.data.narrow(0, off, n).copy_(narrow(loaded, 0, self.tp_rank * n, n, n * self.tp_size, param))


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[:, rank's cols] @ W[:, rank's cols].T: one all-reduce. The bias (if any)
    is added once, after the reduction, so it is not counted tp_size times."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_size()
        assert in_features % self.tp_size == 0, (in_features, self.tp_size)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.tp_size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def weight_loader(self, param, loaded, shard_id=None):
        if param is self.bias:
            param.data.copy_(full(loaded, param))
            return
        n = param.shape[1]
        param.data.copy_(narrow(loaded, 1, self.tp_rank * n, n, n * self.tp_size, param))

    def forward(self, x):
        y = linear(x, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(y)  # plain collective: capturable in a CUDA graph under NCCL, same order on every rank
        return y if self.bias is None else y + self.bias

    def add_norm(self, x, residual, norm):
        """norm(self(x), residual) -> (out, residual, row_norm). On one rank, for decode-sized steps
        over a wide weight, the GEMM's epilogue does the add and the norm but for its 1 / rms, which
        needs every program's columns: out is norm.weight * (y + residual), and row_norm carries the
        per-row sums of squares that the next linear turns into 1 / rms (one norm launch fewer).
        Elsewhere the two launches, row_norm None; norm None: (self(x), residual, None)."""
        if norm is not None and self.tp_size == 1 and self.bias is None and FUSED_NORM and takes(x, self.weight):
            out, residual, parts = skinny_add_norm_triton(x, self.weight, residual, norm.weight)
            return out, residual, (parts, norm.eps)
        y = self(x)
        if norm is None:
            return y, residual, None
        out, residual = norm(y, residual)
        return out, residual, None


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocab rows [r*V/tp, (r+1)*V/tp); tokens outside the slice embed to zero and one
    all-reduce sums the ranks' rows (exactly one rank contributes each token)."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_size()
        assert vocab_size % self.tp_size == 0, (vocab_size, self.tp_size)
        self.part = vocab_size // self.tp_size
        self.start = self.tp_rank * self.part
        self.weight = nn.Parameter(torch.empty(self.part, hidden))

    def weight_loader(self, param, loaded, shard_id=None):
        param.data.copy_(narrow(loaded, 0, self.start, self.part, self.part * self.tp_size, param))

    def forward(self, ids):
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local >= 0) & (local < self.part)
        y = F.embedding(local.clamp(0, self.part - 1), self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the rank's vocab slice, gathered to rank 0 (the only rank that samples); other
    ranks get None. Ties to the embedding by sharing the same (identically sliced) parameter.
    gather=False returns the slice: a CUDA graph captures up to there and `gather` runs after the
    replay, as nano-vllm keeps its logits gather out of the graph."""

    def __init__(self, vocab_size: int, hidden: int, tied_to: VocabParallelEmbedding | None = None):
        super().__init__(vocab_size, hidden)
        if tied_to is not None:
            self.weight = tied_to.weight

    def forward(self, x, gather: bool = True):
        logits = linear(x, self.weight)
        return self.gather(logits) if gather else logits

    def gather(self, logits: torch.Tensor) -> torch.Tensor | None:
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1) if self.tp_rank == 0 else None
