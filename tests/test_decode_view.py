"""The decode-attention reference over a DecodeView equals plain dense attention over the tokens the
view names: G = 1, G = H_kv and G = H_q, page sizes 1 and 16, partial last pages, padded table entries."""
import pytest
import torch

from sparsevllm.kernels.decode_attention import decode_attention_ref


def dense_oracle(q, keys, values, scale):
    """q: [H_q, D]; keys/values: per KV head a [n_h, D] tensor -> [H_q, D]."""
    Hq, Hkv = q.shape[0], len(keys)
    out = torch.empty_like(q, dtype=torch.float64)
    for h in range(Hq):
        g = h // (Hq // Hkv)
        s = (keys[g].double() @ q[h].double()) * scale
        out[h] = torch.softmax(s, 0) @ values[g].double()
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("rows", ["shared", "kv_head", "query_head"])
def test_decode_view_reference_matches_dense_oracle(page_size, rows):
    torch.manual_seed(page_size + 7 * len(rows))
    B, Hq, Hkv, D, num_pages = 3, 8, 2, 16, 64
    P = page_size
    k_cache = torch.randn(num_pages * P, Hkv, D)
    v_cache = torch.randn(num_pages * P, Hkv, D)
    G = {"shared": 1, "kv_head": Hkv, "query_head": Hq}[rows]
    N = 7
    table = torch.zeros(B, G, N, dtype=torch.int32)
    lengths = torch.zeros(B, G, dtype=torch.int32)
    for b in range(B):
        for g in range(G):
            n_pages = torch.randint(1, N + 1, ()).item()
            table[b, g, :n_pages] = torch.randperm(num_pages)[:n_pages].int()
            lengths[b, g] = (n_pages - 1) * P + torch.randint(1, P + 1, ()).item()  # partial last page
    q = torch.randn(B, Hq, D)
    out = decode_attention_ref(q, k_cache, v_cache, table, lengths, P, 0.25)
    for b in range(B):
        for h in range(Hq):   # each query head alone against the tokens its row names
            kvh = h // (Hq // Hkv)
            g = {"shared": 0, "kv_head": kvh, "query_head": h}[rows]
            L = lengths[b, g].item()
            slots = torch.tensor([table[b, g, t // P].item() * P + t % P for t in range(L)])
            want = dense_oracle(q[b, h:h + 1], [k_cache[slots, kvh]], [v_cache[slots, kvh]], 0.25)
            torch.testing.assert_close(out[b, h:h + 1].double(), want, atol=1e-5, rtol=1e-5)


def test_per_head_view_with_equal_rows_equals_shared_view():
    torch.manual_seed(0)
    Hkv, P = 4, 16
    k_cache, v_cache = torch.randn(20 * P, Hkv, 32), torch.randn(20 * P, Hkv, 32)
    table = torch.tensor([[[3, 7, 1]], [[0, 2, 9]]], dtype=torch.int32)
    lengths = torch.tensor([[40], [33]], dtype=torch.int32)
    q = torch.randn(2, 8, 32)
    shared = decode_attention_ref(q, k_cache, v_cache, table, lengths, P, 0.2)
    per_head = decode_attention_ref(q, k_cache, v_cache, table.expand(2, Hkv, 3).contiguous(),
                                    lengths.expand(2, Hkv).contiguous(), P, 0.2)
    torch.testing.assert_close(shared, per_head)


def test_a_manager_that_stores_its_own_way_gets_no_store_in_the_qkv_epilogue():
    """store_target (the qkv GEMM writing K/V on decode steps) must write exactly what store_kv
    would: a registered method that overrides store_kv overrides store_target too, and a method
    that overrides only store_kv gets None (its own store runs)."""
    from types import SimpleNamespace

    from sparsevllm.engine.cache_manager.base import CacheManager
    from sparsevllm.method_registry import methods

    for name, cls in methods().items():
        if cls.store_kv is not CacheManager.store_kv and cls.store_target is CacheManager.store_target:
            assert cls.method_name == "deltakv", name   # compresses pre-RoPE K in its store: keeps store_kv

    class OwnStore(CacheManager):
        def store_kv(self, layer_id, q, k, v, cos_sin_cache, step):
            raise AssertionError("not called here")

    decode = SimpleNamespace(is_prefill=False)
    assert OwnStore.store_target(object.__new__(OwnStore), 0, decode) is None
