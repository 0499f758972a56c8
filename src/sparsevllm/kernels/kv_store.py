"""Write new tokens' K/V into the paged pool through the slot mapping.

slot_mapping[t] is the pool slot of token t; -1 means the row is padding and writes nowhere
(CUDA-graph batches are padded to a bucket size).
"""
import torch

from sparsevllm.kernels.common import jit, pow2, tl, use_triton


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v: [T, H_kv, D]; k_cache, v_cache: [num_slots, H_kv, D]; slot_mapping: [T] int."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[slots] = k[keep].to(k_cache.dtype)
    v_cache[slots] = v[keep].to(v_cache.dtype)


@jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcs, stride_kch, stride_vcs, stride_vch,
                     H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # int64: slot * stride overflows int32 on big pools
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < H) & (dims < D)
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(kc_ptr + slot * stride_kcs + heads * stride_kch + dims,
             k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * stride_vcs + heads * stride_vch + dims,
             v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Same contract as store_kv_ref; one program per token."""
    T, H, D = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and slot_mapping.shape == (T,)
    if T == 0:
        return
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        H=H, D=D, BLOCK_H=pow2(H), BLOCK_D=pow2(D), num_warps=4)


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    if use_triton(k):
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
