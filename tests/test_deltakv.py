"""DeltaKV's runtime: knobs rejected before weights load, the compress -> reconstruct round trip,
causal references that are never freed, equality with vanilla when nothing is compressed or when
decode_keep covers every compressed token (identity compressor), the selection against a naive
float64 oracle, raw slots really freed and returned, the sizing against vanilla, and the kernels
against their references (interpreter on CPU, bf16 and graph == eager on the GPU). The trainer is
tested in test_deltakv_compressor.py."""
import dataclasses
import os
from collections import deque

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import CUDA, gpu, prompts  # noqa: E402
from method_knobs import METHOD_KNOBS  # noqa: E402
from sparsevllm import LLM, SamplingParams  # noqa: E402
from sparsevllm.engine.cache_manager.deltakv import compressor as dc  # noqa: E402
from sparsevllm.engine.cache_manager.cross_layer import layer_roles  # noqa: E402
from sparsevllm.engine.cache_manager.deltakv import DeltaKVCacheManager  # noqa: E402
from sparsevllm.engine.cache_manager.vanilla import VanillaCacheManager  # noqa: E402
from sparsevllm.kernels import deltakv as kd  # noqa: E402
from sparsevllm.method_registry import make_config  # noqa: E402
from sparsevllm.models.config import ModelConfig, read_config_json  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SMALL = dict(METHOD_KNOBS["deltakv"])
interp = pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")


def model(tiny_model, arch="llama"):
    return tiny_model(arch, num_hidden_layers=4)


def compressor(path, out, kind="identity", full=(0, 2), latent=None, seed=0):
    """A compressor saved for the model at path: "identity" (down = up = I, so x_hat = x exactly)
    or "random" (a latent of `latent` dims: lossy)."""
    mc = ModelConfig.from_dict(read_config_json(path))
    F = 2 * mc.num_key_value_heads * mc.head_dim
    cfg = dc.make_config(mc, latent_dim=F if kind == "identity" else latent, full_layers=list(full),
                         cluster_ratio=0.25, neighbors=2, sink=4)
    torch.manual_seed(seed)
    comp = dc.DeltaKVCompressor(cfg)
    if kind == "identity":
        with torch.no_grad():
            for codec in comp.layers.values():
                for lin in (codec.down, codec.up):
                    lin.weight.copy_(torch.eye(F))
                    lin.bias.zero_()
    comp.save(str(out))
    return str(out)


def run(llm, ps, sp=GREEDY):
    outs = llm.generate(ps, sp, use_tqdm=False)
    cm = llm.engine.cache_manager
    assert cm.allocator.is_idle()
    if isinstance(cm, DeltaKVCacheManager):
        assert cm.raw_slots.num_free == cm.raw_slots.num_slots and not cm.requests
        assert len(cm.free_rows) == cm.config.max_num_seqs + 1
    return [o.outputs[0].token_ids for o in outs]


class MostRecentFirst(deque):
    """A free-page list that hands a freed page to the next request at once."""

    def append(self, page):
        self.appendleft(page)


def count_compressions(llm):
    cm = llm.engine.cache_manager
    log = {"tokens": 0}
    compress = cm._compress

    def counted(jobs, *args):
        log["tokens"] += sum(end - start for _, _, start, end in jobs)
        log["calls"] = log.get("calls", 0) + 1
        log["most_batched"] = max(log.get("most_batched", 0), len(jobs))
        return compress(jobs, *args)
    cm._compress = counted
    return log


# ---------------------------------------------------------------- knobs and roles

def test_default_full_layers_are_the_papers_scaled_to_the_depth():
    assert dc.default_full_layers(32) == [0, 1, 2, 8, 18]
    assert dc.default_full_layers(30) == [0, 1, 2, 8, 17]
    assert dc.default_full_layers(4) == [0, 1, 2]
    roles = layer_roles(6, [0, 3])
    assert roles == [("filter", None), ("sparse", 0), ("sparse", 0), ("filter", None), ("sparse", 3), ("sparse", 3)]


@pytest.mark.parametrize("knobs,msg", [
    (dict(), "deltakv_compressor_path is required"),
    (dict(deltakv_compressor_path="/no/such/dir"), "deltakv_compressor_path='/no/such/dir' holds no"),
    (dict(load_format="dummy", deltakv_latent_dim=0), "deltakv_latent_dim=0 is invalid"),
    (dict(load_format="dummy", deltakv_cluster_ratio=1.0), "deltakv_cluster_ratio=1.0 is invalid"),
    (dict(load_format="dummy", deltakv_cluster_ratio=0), "deltakv_cluster_ratio=0 is invalid"),
    (dict(load_format="dummy", deltakv_neighbors=0), "deltakv_neighbors=0 is invalid"),
    (dict(load_format="dummy", deltakv_full_layers=[1, 2]), "deltakv_full_layers=\\[1, 2\\] is invalid"),
    (dict(load_format="dummy", deltakv_full_layers=[0, 0]), "deltakv_full_layers=\\[0, 0\\] is invalid"),
    (dict(load_format="dummy", deltakv_sink=0), "deltakv_sink=0 is invalid"),
    (dict(load_format="dummy", deltakv_recent=0), "deltakv_recent=0 is invalid"),
    (dict(load_format="dummy", deltakv_decode_keep=0), "deltakv_decode_keep=0 is invalid"),
    (dict(load_format="dummy", deltakv_compress_windows=0), "deltakv_compress_windows=0 is invalid"),
    (dict(load_format="dummy", deltakv_compress_steps=0), "deltakv_compress_steps=0 is invalid"),
    (dict(load_format="dummy", deltakv_compress_steps=129), "deltakv_compress_steps=129 is invalid.*deltakv_recent"),
])
def test_bad_knobs_are_rejected_before_any_model_loads(knobs, msg):
    with pytest.raises(ValueError, match=msg):
        make_config("/no/such/model", "deltakv", **knobs)


@pytest.fixture
def no_weights(monkeypatch):
    from sparsevllm.engine import model_runner

    def no_load(*a, **k):
        raise AssertionError("weights started loading")
    monkeypatch.setattr(model_runner, "load_weights", no_load)
    monkeypatch.setattr(model_runner, "init_dummy_weights", no_load)


def test_full_layers_out_of_range_fail_before_weights_load(tiny_model, no_weights):
    with pytest.raises(ValueError, match=r"deltakv_full_layers=\[0, 4\] is out of range .* 4 layers"):
        LLM(model(tiny_model), vllm_sparse_method="deltakv", load_format="dummy", deltakv_full_layers=[0, 4],
            device="cpu")


def test_mismatched_compressor_fails_before_weights_load(tiny_model, tmp_path, no_weights):
    other = compressor(tiny_model("llama", num_hidden_layers=4, num_key_value_heads=4), tmp_path / "c")
    with pytest.raises(ValueError, match="deltakv_compressor_path=.*another model shape.*num_key_value_heads"):
        LLM(model(tiny_model), vllm_sparse_method="deltakv", deltakv_compressor_path=other, device="cpu")
    comp = compressor(model(tiny_model), tmp_path / "d", full=(0, 2))
    with pytest.raises(ValueError, match="no codec for sparse layers \\[2\\]"):
        LLM(model(tiny_model), vllm_sparse_method="deltakv", deltakv_compressor_path=comp,
            deltakv_full_layers=[0], device="cpu")
    with pytest.raises(ValueError, match="deltakv_latent_dim=8 contradicts"):
        LLM(model(tiny_model), vllm_sparse_method="deltakv", deltakv_compressor_path=comp, deltakv_latent_dim=8,
            device="cpu")



def test_reference_knobs_left_unset_follow_the_compressor(tiny_model, tmp_path, caplog):
    """cluster_ratio / neighbors / sink define the references the compressor was trained against:
    unset, they are the compressor's (this one: 0.25 / 2 / 4), not the paper's defaults 0.1 / 4 / 8;
    a different value given on purpose is kept, with a warning."""
    from sparsevllm.method_registry import make_config
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c")
    mc = ModelConfig.from_dict(read_config_json(path))

    def knobs(**kw):
        config = make_config(path, "deltakv", deltakv_compressor_path=comp, **kw)
        DeltaKVCacheManager.validate_model(config, mc)
        k = config.method_config
        return k.deltakv_cluster_ratio, k.deltakv_neighbors, k.deltakv_sink

    assert knobs() == (0.25, 2, 4)
    with caplog.at_level("WARNING"):
        assert knobs(deltakv_neighbors=3) == (0.25, 3, 4)
    assert "deltakv_neighbors=3 differs from the 2 the compressor was trained with" in caplog.text
    dummy = make_config(path, "deltakv", load_format="dummy").method_config
    assert (dummy.deltakv_cluster_ratio, dummy.deltakv_neighbors, dummy.deltakv_sink) == (0.1, 4, 8)


# ---------------------------------------------------------------- kernels: round trip, causality

def pool_case(n, H=2, D=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    angle = torch.arange(n).view(-1, 1) * torch.rand(1, D // 2, generator=g)   # a true rotation per position
    cos_sin = torch.cat([torch.cos(angle), torch.sin(angle)], dim=1)
    k = torch.randn(2 * n, H, D, generator=g).to(dtype)
    v = torch.randn(2 * n, H, D, generator=g).to(dtype)
    slots = torch.randperm(2 * n, generator=g)[:n]
    return k, v, slots, cos_sin


def test_gather_x_undoes_rope():
    n, H, D = 40, 2, 8
    k, v, slots, cos_sin = pool_case(n, H, D)
    pos = torch.arange(n)
    x = kd.gather_x_ref(k, v, slots, pos, cos_sin)
    cos, sin = cos_sin[pos].unsqueeze(1).chunk(2, dim=-1)
    k_pre = x[:, :H * D].view(n, H, D)
    a, b = k_pre.chunk(2, dim=-1)
    torch.testing.assert_close(torch.cat([a * cos - b * sin, b * cos + a * sin], -1), k[slots])
    torch.testing.assert_close(x[:, H * D:].view(n, H, D), v[slots])


def test_references_are_causal_and_equal_the_compressors_mean():
    g = torch.Generator().manual_seed(1)
    T, F, sink, stride, k = 60, 12, 3, 4, 3
    x = torch.randn(T, F, generator=g)
    is_ref = dc.reference_mask(T, sink, stride)
    ref_pos = torch.nonzero(is_ref).squeeze(-1)
    tok_pos = torch.nonzero(~is_ref).squeeze(-1)
    codec = dc.LayerCodec(F, F, "linear")
    with torch.no_grad():
        codec.down.weight.copy_(torch.eye(F))
        codec.down.bias.zero_()
    z, nbr = kd.compress_block(x[tok_pos], x[ref_pos], ref_pos, tok_pos, k, codec, chunk=7)
    assert (nbr < tok_pos.view(-1, 1)).all() and (nbr >= 0).all()            # only earlier references
    assert is_ref[nbr.long()].all()
    want_r = dc.nearest_reference_mean(x, is_ref, k)[tok_pos]
    torch.testing.assert_close(x[tok_pos] - z, want_r, atol=1e-5, rtol=1e-5)  # z = down(x) - down(r), down = I
    for i, t in enumerate(tok_pos.tolist()):                                  # naive: the k nearest earlier refs
        earlier = [p for p in ref_pos.tolist() if p < t]
        d = {p: float((x[t] - x[p]).double().norm()) for p in earlier}
        assert sorted(nbr[i].tolist()) == sorted(sorted(earlier, key=lambda p: (d[p], p))[:k])


def test_shortlist_then_exact_ranking_equals_the_full_ranking():
    """The GPU path: a bf16 GEMM shortlists candidates, compress_block ranks them in fp32. Two
    requests padded to one batch (padding tokens at -1, padding references after every token), a
    shortlist longer than some tokens' earlier references, another shorter than the references."""
    g = torch.Generator().manual_seed(3)
    F, k = 64, 4
    codec = dc.LayerCodec(F, 16, "linear")
    tok_pos = torch.tensor([[2, 9, 13, 40, 77, 90, 99, -1], [7, 11, 30, 31, 52, 66, -1, -1]])
    ref_pos = torch.tensor([[0, 1, 2, 3, 4, 8, 12, 16, 20, 24, 28, 32, 36, 44, 52, 60, 68, 76, 84, 92],
                            [0, 1, 2, 3, 6, 10, 14, 18, 22, 26, 34, 42, 50, 58, 62, 1 << 40, 1 << 40, 1 << 40,
                             1 << 40, 1 << 40]])
    x = torch.randn(2, tok_pos.shape[1], F, generator=g)
    refs = torch.randn(2, ref_pos.shape[1], F, generator=g)
    want_z, want_nbr = kd.compress_block(x, refs, ref_pos, tok_pos, k, codec)
    for size in (6, 12, 32):
        idx = kd.shortlist(x, refs.to(torch.bfloat16), refs.square().sum(-1), ref_pos, tok_pos, size)
        assert idx.shape == (2, tok_pos.shape[1], min(size, ref_pos.shape[1]))
        cand = torch.gather(refs.unsqueeze(1).expand(-1, idx.shape[1], -1, -1), 2,
                            idx.unsqueeze(-1).expand(-1, -1, -1, F))
        z, nbr = kd.compress_block(x, cand, ref_pos.gather(1, idx.flatten(1)).view(idx.shape), tok_pos, k, codec)
        assert torch.equal(nbr, want_nbr)
        torch.testing.assert_close(z, want_z, atol=1e-5, rtol=1e-5)
    assert want_nbr[0, 0].sort().values.tolist() == [-1, -1, 0, 1] and (want_nbr[0, -1] == -1).all()


def test_engine_with_the_shortlist_equals_the_full_ranking(tiny_model, tmp_path, monkeypatch):
    """The shortlist path (on by default on the GPU for decode-time compressions) forced on the CPU:
    same references, latents and tokens as ranking every reference in fp32, with a shortlist shorter
    than the references; prefill chunks (more tokens a request than SHORTLIST_TOKENS) rank fully."""
    from sparsevllm.engine.cache_manager.deltakv import compression as deltakv
    monkeypatch.setattr(deltakv, "SHORTLIST", 8)
    monkeypatch.setattr(deltakv, "SHORTLIST_TOKENS", 64)   # decode windows: shortlist, in several rounds
    monkeypatch.setattr(deltakv, "REF_BUCKET", 16)      # decode windows padded: tokens to 8, references to 16
    monkeypatch.setattr(deltakv, "TOKEN_BUCKET", 8)
    rounds = []
    monkeypatch.setattr(deltakv, "shortlist",
                        lambda x, refs, *a: rounds.append((*x.shape, refs.shape[1])) or kd.shortlist(x, refs, *a))
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "random", latent=4)
    ps = prompts([300, 132, 200], seed=8)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = []
    for forced in (False, True):
        llm = LLM(path, vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp,
                  deltakv_decode_keep=8, **SMALL)
        cm = llm.engine.cache_manager
        cm.shortlist = forced
        results.append((run(llm, ps, sp), cm))
    (full, cm_f), (short, cm_s) = results
    assert cm_s.neighbors.ge(0).sum() > 100        # many tokens were compressed
    assert rounds and max(b * n for b, n, _, _ in rounds) <= 64    # the shortlist ran, on decode windows only
    assert all(r % 16 == 0 for _, _, _, r in rounds)             # reference counts repeat across events
    assert torch.equal(cm_f.neighbors, cm_s.neighbors)
    torch.testing.assert_close(cm_f.latents, cm_s.latents, atol=1e-5, rtol=1e-5)
    assert full == short


def recon_case(B=3, C=20, S=8, H=2, D=8, NBR=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n = 64
    k, v, _, cos_sin = pool_case(n, H, D, seed, dtype)
    raw_map = torch.randint(0, 2 * n, (B + 1, n), generator=g, dtype=torch.int32)
    raw_map[torch.rand(B + 1, n, generator=g) < 0.5] = -1
    raw_map[:, :4] = torch.randint(0, 2 * n, (B + 1, 4), generator=g, dtype=torch.int32)   # references: raw
    view_pos = torch.randint(4, n, (B, C), generator=g, dtype=torch.int32)
    lengths = torch.tensor([C, C // 2, 1][:B], dtype=torch.int32)
    rows = torch.tensor([2, 0, 3][:B])
    up_z = torch.randn(B, S, 2 * H * D, generator=g).to(dtype)
    nbr = torch.randint(0, 4, (B, S, NBR), generator=g, dtype=torch.int32)
    nbr[0, 0, 1] = -1
    nbr[1, 1] = -1                    # no reference at all: up(z) alone
    # the latent store: the selected tokens' rows scattered among others
    M = B * S + 7
    latent_slots = torch.randperm(M, generator=g)[:B * S].view(B, S)
    neighbors = torch.randint(0, 4, (M, NBR), generator=g, dtype=torch.int32)
    neighbors[latent_slots.flatten()] = nbr.view(-1, NBR)
    return view_pos, lengths, rows, raw_map, k, v, up_z, neighbors, latent_slots, 3, cos_sin


def test_compress_then_reconstruct_with_an_identity_compressor_is_exact():
    n, H, D, sink, stride = 50, 2, 8, 4, 3
    k, v, slots, cos_sin = pool_case(n, H, D)
    is_ref = dc.reference_mask(n, sink, stride)
    ref_pos, tok_pos = torch.nonzero(is_ref).squeeze(-1), torch.nonzero(~is_ref).squeeze(-1)
    F = 2 * H * D
    codec = dc.LayerCodec(F, F, "linear")
    with torch.no_grad():
        for lin in (codec.down, codec.up):
            lin.weight.copy_(torch.eye(F))
            lin.bias.zero_()
    x = kd.gather_x_ref(k, v, slots[tok_pos], tok_pos, cos_sin)
    refs = kd.gather_x_ref(k, v, slots[ref_pos], ref_pos, cos_sin)
    z, nbr = kd.compress_block(x, refs, ref_pos, tok_pos, 2, codec)
    raw_map = torch.full((1, n), -1, dtype=torch.int32)
    raw_map[0, ref_pos] = slots[ref_pos].to(torch.int32)                    # compressed tokens: freed
    view_pos = tok_pos.view(1, -1).to(torch.int32)
    C = view_pos.shape[1]
    out_k, out_v = torch.zeros(C, H, D), torch.zeros(C, H, D)
    with torch.no_grad():
        up_z = codec.up(z).view(1, C, F)
    kd.reconstruct_ref(view_pos, torch.tensor([C]), torch.tensor([0]), raw_map, k, v, up_z, nbr,
                       torch.arange(C).view(1, C), 0,
                       cos_sin, out_k, out_v)
    torch.testing.assert_close(out_k, k[slots[tok_pos]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_v, v[slots[tok_pos]], atol=1e-5, rtol=1e-5)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_x_triton_matches_reference(dtype):
    k, v, slots, cos_sin = pool_case(30, 2, 8, dtype=dtype)
    pos = torch.arange(30)
    torch.testing.assert_close(kd.gather_x_triton(k, v, slots, pos, cos_sin), kd.gather_x_ref(k, v, slots, pos, cos_sin),
                               atol=1e-3, rtol=1e-3)


@interp
@pytest.mark.parametrize("dtype,nbr", [(torch.float32, 2), (torch.float16, 2), (torch.float32, 3)])
def test_reconstruct_triton_matches_reference(dtype, nbr):
    args = recon_case(NBR=nbr, dtype=dtype)
    B, C = args[0].shape
    H, D = args[4].shape[1:]
    outs = []
    for fn in (kd.reconstruct_ref, kd.reconstruct_triton):
        o_k, o_v = torch.full((B * C, H, D), 7.0, dtype=dtype), torch.full((B * C, H, D), 7.0, dtype=dtype)
        fn(*args, o_k, o_v)
        outs.append((o_k, o_v))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=2e-3, rtol=2e-3)


@interp
@pytest.mark.parametrize("dtype,bias,shape", [(torch.float32, True, (3, 70)), (torch.float16, True, (130,)),
                                              (torch.float32, False, (2, 5))])
def test_gather_linear_triton_matches_reference(dtype, bias, shape):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 24, generator=g).to(dtype)
    rows = torch.randint(0, 300, shape, generator=g, dtype=torch.int32)
    w = (torch.randn(200, 24, generator=g) / 5).to(dtype)
    b = torch.randn(200, generator=g).to(dtype) if bias else None
    got = kd.gather_linear_triton(x, rows, w, b)
    assert got.shape == (*shape, 200)
    torch.testing.assert_close(got.float(), kd.gather_linear_ref(x, rows, w, b).float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kind", ["linear", "mlp_gelu"])
def test_up_of_gathered_latents_equals_up_of_the_gather(kind):
    torch.manual_seed(0)
    codec = dc.LayerCodec(40, 12, kind)
    latents = torch.randn(90, 12)
    slots = torch.randint(0, 90, (3, 17))
    torch.testing.assert_close(kd.up_of(codec.up, latents, slots), codec.up(latents[slots]))


@pytest.mark.long   # each kernel's reference is compared in the quick suite; this is their wiring
@interp
def test_engine_with_the_triton_kernels_equals_the_references(tiny_model, tmp_path, monkeypatch):
    """The decode and prefill paths with every DeltaKV Triton kernel (interpreted on the CPU) give
    the tokens the torch references give: the GPU wiring, short of graphs."""
    from sparsevllm.engine.cache_manager.deltakv import compression, manager
    from sparsevllm.kernels import token_select
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "random", latent=6)
    ps = prompts([150, 90], seed=11)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    knobs = dict(vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp, deltakv_decode_keep=12,
                 chunk_prefill_size=64, **SMALL)
    want = run(LLM(path, **knobs), ps, sp)
    monkeypatch.setattr(manager, "reconstruct", kd.reconstruct_triton)
    monkeypatch.setattr(compression, "gather_x", kd.gather_x_triton)
    monkeypatch.setattr(manager, "select_tokens", token_select.select_tokens_triton)
    monkeypatch.setattr(kd, "gather_linear", kd.gather_linear_triton)
    assert run(LLM(path, **knobs), ps, sp) == want


# ---------------------------------------------------------------- engine: equal to vanilla

@pytest.mark.parametrize("chunk", [4096, 64])
def test_deltakv_equals_vanilla_when_nothing_is_compressed(tiny_model, tmp_path, chunk):
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "random", latent=4)
    ps = prompts([20, 7, 33], seed=2)            # context stays within sink + 2 windows (4 + 32 + 12)
    want = run(LLM(path, device="cpu", chunk_prefill_size=chunk), ps)
    llm = LLM(path, vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp,
              chunk_prefill_size=chunk, **{k: v for k, v in SMALL.items() if k != "deltakv_recent"},
              deltakv_recent=32)
    log = count_compressions(llm)
    assert run(llm, ps) == want and log["tokens"] == 0


@pytest.mark.parametrize("lengths,chunk,windows", [([300], 4096, 1), ([300, 170, 45], 4096, 1), ([230, 301], 64, 1),
                                                  ([300, 170, 45], 4096, 3), ([230, 301], 64, 2)])
def test_deltakv_equals_vanilla_when_decode_keep_covers_every_compressed_token(tiny_model, tmp_path, lengths, chunk,
                                                                              windows, monkeypatch):
    from sparsevllm.engine.cache_manager.deltakv import compression as deltakv
    monkeypatch.setattr(deltakv, "COMPRESS_CHUNK", 16)   # a long prompt's compression runs in chunks
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "identity")
    ps = prompts(lengths, seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)   # decode compresses too
    want = run(LLM(path, device="cpu", chunk_prefill_size=chunk), ps, sp)
    llm = LLM(path, vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp,
              chunk_prefill_size=chunk, deltakv_decode_keep=512, deltakv_compress_windows=windows, **SMALL)
    log = count_compressions(llm)
    assert run(llm, ps, sp) == want
    assert log["tokens"] > sum(lengths) // 2          # most of the context went through the latents


@pytest.mark.long   # several windows a time are also among the equal-to-vanilla cases
def test_compress_windows_takes_several_windows_a_time_and_the_same_latents(tiny_model, tmp_path):
    """deltakv_compress_windows = 3: decode compresses 3 windows at once when the raw tail reaches 4
    (a third of the events), the tail never holds more, and a token compressed under both settings
    gets the same latent and references (they depend on the token and the raw references only; the
    identity compressor and a keep covering everything make both runs generate the same tokens)."""
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "identity")
    ps = prompts([150, 97], seed=9)
    sp = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    w, sink = SMALL["deltakv_recent"], SMALL["deltakv_sink"]
    seen = {}
    for m in (1, 3):
        llm = LLM(path, vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp,
                  deltakv_decode_keep=512, deltakv_compress_windows=m, **SMALL)
        cm = llm.engine.cache_manager
        log, tails, compress = {"sizes": []}, [], cm._compress

        def counted(jobs, *args, compress=compress, log=log):
            log["sizes"] += [end - start for _, _, start, end in jobs]
            return compress(jobs, *args)
        cm._compress = counted
        end_step = cm.on_step_end

        def watched(step, end_step=end_step, cm=cm):
            end_step(step)
            tails.extend(s.cache_len + n - cm.requests[s.seq_id].comp_end for s, n in zip(step.seqs, step.num_tokens))
        cm.on_step_end = watched
        for p in ps:
            llm.generate([p], sp, use_tqdm=False)          # alone: the slots of a token equal across runs
            seen[m, len(seen)] = (cm.latents.clone(), cm.neighbors.clone())
        decode_sizes = [x for x in log["sizes"] if x == m * w]
        # a decode-time compression takes effect spread - 1 steps after the tail reaches m + 1 windows
        assert max(tails) == (m + 1) * w + cm.spread - 2 and decode_sizes and cm.spread > 1
        assert sum(cm.method_config.compressed_until(len(p), len(p) + 120, cm.spread) - sink for p in ps) == sum(log["sizes"])
        assert cm.raw_slots.num_free == cm.raw_slots.num_slots
    for i in range(2):
        (lat1, nbr1), (lat3, nbr3) = seen[1, i], seen[3, i + 2]
        both = (nbr1[..., 0] >= 0) & (nbr3[..., 0] >= 0)    # compressed in both runs
        assert both.sum() > 100
        assert torch.equal(nbr1[both], nbr3[both])
        torch.testing.assert_close(lat1[both], lat3[both], atol=1e-5, rtol=1e-5)


def test_requests_compressed_together_equal_one_at_a_time(tiny_model, tmp_path, monkeypatch):
    """Decode ages out a window in requests of equal (length - sink) mod recent at the same step; they
    are compressed as one padded batch. Latents, references and tokens equal compressing each
    request alone (COMPRESS_REFS = 1 puts every request in its own batch)."""
    from sparsevllm.engine.cache_manager.deltakv import compression as deltakv
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "random", latent=4)
    ps = prompts([100, 132, 68], seed=6)        # 96, 128, 64 past the sink: multiples of the window
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    knobs = dict(vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp, deltakv_decode_keep=8,
                 **SMALL)
    results = []
    for refs in (deltakv.COMPRESS_REFS, 1):
        monkeypatch.setattr(deltakv, "COMPRESS_REFS", refs)
        llm = LLM(path, **knobs)
        log = count_compressions(llm)
        results.append((run(llm, ps, sp), llm.engine.cache_manager, log))
    (together, cm_t, log_t), (alone, cm_a, log_a) = results
    assert log_t["most_batched"] == 3 and log_a["most_batched"] == 1 and log_t["tokens"] == log_a["tokens"]
    assert together == alone
    torch.testing.assert_close(cm_t.latents, cm_a.latents, atol=1e-5, rtol=1e-5)
    assert torch.equal(cm_t.neighbors, cm_a.neighbors)


def test_deltakv_differs_from_vanilla_when_it_selects_and_compresses(tiny_model, tmp_path):
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "random", latent=4)
    ps = prompts([400], seed=4)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = run(LLM(path, device="cpu"), ps, sp)
    got = run(LLM(path, vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp,
                  deltakv_decode_keep=8, **SMALL), ps, sp)
    assert got != want


# ---------------------------------------------------------------- selection oracle, storage

def check_views(llm, log):
    """Every sparse run's selection equals a float64 oracle from the scoring layer's query and keys;
    the view is sink + selected + raw tail, distinct positions below the query's."""
    cm = llm.engine.cache_manager
    build, select = cm.build_decode_view, cm._select
    captured = {}

    def build_logged(layer_id, q, step):
        if cm.roles[layer_id][0] == "filter" and cm.roles[min(layer_id + 1, cm.num_layers - 1)][0] == "sparse":
            captured["q"], captured["layer"] = q.clone(), layer_id
        return build(layer_id, q, step)

    def select_checked(scores, step):
        view_pos, lengths, latent_slots = select(scores, step)
        knobs = cm.method_config
        sink, keep, P = knobs.deltakv_sink, knobs.deltakv_decode_keep, cm.page_size
        q, layer = captured["q"], captured["layer"]
        k_cache = cm.pool.layer(cm.index[layer])[0]
        Hq, Hkv = q.shape[1], k_cache.shape[1]
        for b, seq in enumerate(step.seqs):
            req = cm.requests[seq.seq_id]
            length, comp_end = int(step.cache_lens[b]), req.comp_end
            row = step.block_tables[b].tolist()
            score = {}
            for j in range(sink, comp_end):
                key = k_cache[row[j // P] * P + j % P].double()
                score[j] = max(float(q[b, h].double() @ key[h // (Hq // Hkv)]) for h in range(Hq)) / cm.head_dim ** 0.5
            want = sorted(sorted(score, key=lambda j: (-score[j], j))[:keep])
            n = int(lengths[b])
            got = view_pos[b, :n].tolist()
            n_sel = n - sink - (length - comp_end)
            assert got[:sink] == list(range(sink)) and got[sink + n_sel:] == list(range(comp_end, length))
            chosen = got[sink:sink + n_sel]
            assert chosen == sorted(set(chosen)) and all(sink <= j < comp_end for j in chosen)
            if chosen != want:   # fp32 scores: allow swaps only between near-ties
                cut = sorted(score.values(), reverse=True)[len(want) - 1]
                assert len(chosen) == len(want) and all(abs(score[j] - cut) < 1e-4 for j in set(chosen) ^ set(want))
            log["sparse"] += n_sel < comp_end - sink
            log["views"] += 1
        return view_pos, lengths, latent_slots
    cm.build_decode_view, cm._select = build_logged, select_checked
    return llm


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_deltakv_selection_equals_oracle_and_is_causal(tiny_model, tmp_path, arch):
    path = model(tiny_model, arch)
    comp = compressor(path, tmp_path / "c", "random", latent=6)
    log = {"sparse": 0, "views": 0}
    llm = check_views(LLM(path, vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp,
                          deltakv_decode_keep=10, **SMALL), log)
    run(llm, prompts([150, 90, 64], seed=5), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert log["views"] > 0 and log["sparse"] > 0


def test_compressed_tokens_free_their_raw_slots_and_references_stay(tiny_model, tmp_path):
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "random", latent=4)
    llm = LLM(path, vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp, **SMALL)
    cm = llm.engine.cache_manager
    seen = []
    on_step_end = cm.on_step_end

    def checked(step):
        on_step_end(step)
        for seq, n in zip(step.seqs, step.num_tokens):
            req, length = cm.requests[seq.seq_id], seq.cache_len + n
            held = np.flatnonzero(req.slots[:length] >= 0)
            sink, stride = 4, 4
            refs = [p for p in range(sink, req.comp_end) if (p - sink) % stride == 0]
            assert held.tolist() == list(range(sink)) + refs + list(range(req.comp_end, length))
            # every latent's references are still raw
            i = 0
            for p in range(sink, req.comp_end):
                if (p - sink) % stride:
                    slot = cm.tables.arrays[seq.seq_id][p // cm.page_size] * cm.page_size + p % cm.page_size
                    nbr = cm.neighbors[i][slot]
                    assert ((nbr < p) & (nbr >= 0)).all() and (req.slots[nbr.long().numpy()] >= 0).all()
                    assert (cm.raw_map[req.row, nbr.long()] >= 0).all()
            seen.append((length, len(held)))
    cm.on_step_end = checked
    run(llm, prompts([500], seed=6), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    length, held = seen[-1]
    assert held < length / 3      # sink + a quarter of the compressed (references) + at most two windows
    assert cm.raw_slots.peak_used >= 500


def test_sizing_admits_about_three_times_as_many_128k_requests_as_vanilla(preset_model):
    """Llama-3.1-8B's shape, 110 GiB of KV budget: vanilla's pages hold 6 requests of 128K + 256
    tokens; DeltaKV's split of the same bytes (raw room for a prefill step's chunk and the scratch
    off the top) holds over three times as many, counting pages and raw slots."""
    from sparsevllm.engine.cache_manager.deltakv.config import split_budget
    knobs = dict(max_model_len=131072 + 256, max_num_seqs=64, load_format="dummy")
    cfg = make_config(None, "deltakv", **knobs)
    cfg.method_config.deltakv_full_layers = dc.default_full_layers(32)
    cfg.method_config.deltakv_latent_dim = 128
    budget, L = 110 << 30, 131072 + 256
    va = VanillaCacheManager.bytes_per_page(make_config(None, **knobs), 32, 8, 128, torch.bfloat16)
    vanilla_fit = (budget // va) // -(-L // 16)
    pages, raw = split_budget(cfg, budget // DeltaKVCacheManager.bytes_per_page(cfg, 32, 8, 128, torch.bfloat16),
                              32, 8, 128, torch.bfloat16)
    per_request_raw = 8 + L // 10 + 2 * 128 + 1
    deltakv_fit = min(pages // -(-L // 16), (raw - 8192) // per_request_raw)   # one chunk raw in prefill
    assert vanilla_fit == 6 and deltakv_fit >= 3 * vanilla_fit, deltakv_fit
    model = preset_model("llama-3.1-8b")
    held = DeltaKVCacheManager.kv_tokens_held(cfg, model, 131072, 256)
    assert held <= 0.35 * L
    read = DeltaKVCacheManager.decode_kv_tokens_read(cfg, model, 131072, 131072 + 100)
    assert read < 0.35 * 131072


def test_roofline_counts_a_latent_in_the_models_own_token_width(preset_model):
    """A latent of latent_dim elements costs latent_dim / (2 H_kv D) of a raw token. With half
    Llama-3.1-8B's KV heads (2 H_kv D = 1024, not its 2048) each compressed token's latent weighs
    twice as much, in what a decode step reads and in what a request holds; the raw part is the same."""
    cfg = make_config(None, "deltakv", load_format="dummy")
    knobs = cfg.method_config
    knobs.deltakv_full_layers = dc.default_full_layers(32)
    knobs.deltakv_latent_dim = 128
    llama = preset_model("llama-3.1-8b")
    narrow = dataclasses.replace(llama, num_key_value_heads=4)
    sparse_share = (32 - len(knobs.deltakv_full_layers)) / 32   # the layers that hold latents
    extra = 1 / 1024 - 1 / 2048                                  # one element's weight, narrow minus llama
    L, out = 131072, 256
    read = [DeltaKVCacheManager.decode_kv_tokens_read(cfg, m, L, L + 100) for m in (llama, narrow)]
    # At 128K every one of decode_keep rebuilt tokens is compressed: its latent and its int32 neighbour ids.
    per_rebuilt = 128 + 2 * knobs.deltakv_neighbors
    assert read[1] - read[0] == pytest.approx(sparse_share * knobs.deltakv_decode_keep * per_rebuilt * extra)
    held = [DeltaKVCacheManager.kv_tokens_held(cfg, m, L, out) for m in (llama, narrow)]
    compressed = L + out - knobs.deltakv_sink - knobs.max_tail
    assert held[1] - held[0] == pytest.approx(sparse_share * compressed * 128 * extra, abs=1)   # both rounded up


@pytest.mark.long   # requests of 900 tokens
def test_same_memory_decodes_more_long_requests_together_than_vanilla(tiny_model, tmp_path):
    """The pool sized from the same cpu_kv_cache_gb: vanilla decodes 5 requests of 900 tokens at
    once, DeltaKV (7 of 8 layers compressed) twice as many, in no more bytes."""
    path = tiny_model("llama", num_hidden_layers=8)
    comp = compressor(path, tmp_path / "c", "random", full=(0,), latent=4)
    common = dict(device="cpu", max_num_seqs=12, max_num_batched_tokens=256, chunk_prefill_size=256,
                  cpu_kv_cache_gb=0.01, max_model_len=1024)
    small = {**SMALL, "deltakv_full_layers": [0], "deltakv_decode_keep": 16}
    ps = prompts([900] * 12, seed=12)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    peaks, pools = [], []
    for knobs in ({}, dict(vllm_sparse_method="deltakv", deltakv_compressor_path=comp, **small)):
        llm = LLM(path, **common, **knobs)
        running, step, peak = llm.engine.scheduler.running, llm.engine.step, [0]

        def counted(step=step, running=running, peak=peak):
            out = step()
            peak[0] = max(peak[0], sum(not s.in_prefill for s in running))
            return out
        llm.engine.step = counted
        run(llm, ps, sp)
        peaks.append(peak[0])
        pools.append(llm.engine.cache_manager.memory_accounting()["kv_pool_bytes"])
    assert pools[1] <= pools[0] and peaks[0] == 5 and peaks[1] >= 2 * peaks[0], (peaks, pools)


def test_a_prompt_that_fits_a_small_pool_is_served_as_vanilla_serves_it(tiny_model, tmp_path):
    """A pool so small that its raw slots are capped at every token raw (4 pages of 16: 66 slots):
    a 62-token prompt fits (vanilla serves it), and DeltaKV must too. Admission used to count the
    prompt's references twice (once in its raw part, once more as references) and failed it with
    "no longer fits the KV pool"."""
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "identity")
    ps = prompts([62], seed=13)
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    common = dict(device="cpu", num_kv_pages=4, max_num_seqs=2, max_model_len=512)
    want = run(LLM(path, **common), ps, sp)
    llm = LLM(path, vllm_sparse_method="deltakv", deltakv_compressor_path=comp, deltakv_decode_keep=512, **common,
              **SMALL)
    assert llm.engine.cache_manager.num_pages == 4
    assert want and run(llm, ps, sp) == want


def test_a_prompt_that_exactly_fills_the_pool_is_served_when_it_needs_no_decode(tiny_model, tmp_path):
    """max_tokens=1 finishes at prefill, so no decode token's KV is ever stored: a 64-token prompt
    in 4 pages of 16 must run, as vanilla runs it."""
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "identity")
    ps = prompts([64], seed=13)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    common = dict(device="cpu", num_kv_pages=4, max_num_seqs=2, max_model_len=512)
    want = run(LLM(path, device="cpu", max_model_len=512), ps, sp)
    llm = LLM(path, vllm_sparse_method="deltakv", deltakv_compressor_path=comp, deltakv_decode_keep=512, **common,
              **SMALL)
    cm = llm.engine.cache_manager
    assert cm.num_pages == 4
    assert want and run(llm, ps, sp) == want   # run() checks the allocator and raw slots are idle again


def test_a_prompt_chunked_by_the_step_budget_is_admitted_for_its_real_chunks(tiny_model, tmp_path):
    """max_num_batched_tokens=64 under the default chunk_prefill_size (4096): a 700-token prompt is
    prefilled 64 tokens a step and its raw peak (~290 slots) fits the pool's 352. Admission used to
    count a 4096-token chunk and failed it with "no longer fits the KV pool"."""
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "random", latent=4)
    llm = LLM(path, vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp, num_kv_pages=64,
              max_num_seqs=2, max_model_len=1024, max_num_batched_tokens=64, deltakv_decode_keep=8, **SMALL)
    cm = llm.engine.cache_manager
    assert cm.raw_slots.num_slots < 700
    out = llm.generate(prompts([700], seed=1), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert cm.allocator.is_idle() and cm.raw_slots.num_free == cm.raw_slots.num_slots


def test_memory_accounting_shows_freed_raw_slots(tiny_model, tmp_path):
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "random", latent=4)
    llm = LLM(path, vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp, **SMALL)
    cm = llm.engine.cache_manager
    before = cm.memory_accounting()
    used = []
    on_step_end = cm.on_step_end

    def logged(step):
        on_step_end(step)
        used.append(cm.memory_accounting()["used_raw_slots"])
    cm.on_step_end = logged
    run(llm, prompts([400], seed=7), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert before["used_raw_slots"] == 0 and used[0] < 400 / 2
    assert cm.memory_accounting()["used_raw_slots"] == 0


def test_chunked_prefill_never_holds_the_prompt_raw(tiny_model, tmp_path):
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "random", latent=4)
    llm = LLM(path, vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp, chunk_prefill_size=64,
              max_num_batched_tokens=64, **SMALL)
    run(llm, prompts([600], seed=8), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    sink, w, stride = 4, 16, 4
    assert llm.engine.cache_manager.raw_slots.peak_used <= sink + 2 * w + 64 + 600 // stride + 1


@pytest.mark.long   # overlap with compressions also runs in the quick suite, spread over steps
def test_overlap_equals_no_overlap_with_compressions_and_mixed_finishes(tiny_model, tmp_path):
    """async_scheduling on == off, token for token and finish reason, while decode steps compress
    windows, requests end at different steps (a stop token costs one discarded step, whose
    compression is thrown away with the request) and everything returns to the pools. Under a tight
    pool overlap may preempt where the synchronous engine did not (a finished request's extra step
    holds its pages one step longer); a preempted DeltaKV request is recomputed by chunked prefill,
    where its generated tokens attend to the whole rebuilt prefix instead of the decode view they
    had, so only the requests neither run preempted must match token for token."""
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "random", latent=4)
    ps = prompts([300, 90, 150, 41, 200], seed=13)
    free = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    knobs = dict(vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp, deltakv_decode_keep=8,
                 chunk_prefill_size=64, **SMALL)
    reference = run(LLM(path, async_scheduling=False, **knobs), ps, free)
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, stop_token_ids=[reference[0][30]]),
              SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, stop_token_ids=[reference[2][45]]),
              SamplingParams(temperature=0.0, max_tokens=38, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, max_tokens=50, ignore_eos=True, seed=3)]

    def outcome(llm):
        preempted, preempt = set(), llm.engine.scheduler.preempt
        llm.engine.scheduler.preempt = lambda seq: preempted.add(ps.index(seq.token_ids[:seq.num_prompt_tokens])) or preempt(seq)
        outs = llm.generate(ps, params, use_tqdm=False)
        cm = llm.engine.cache_manager
        assert cm.allocator.is_idle() and cm.raw_slots.num_free == cm.raw_slots.num_slots and not cm.requests
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], preempted

    for extra in ({}, {"num_kv_pages": 60, "page_size": 8}):   # 60 pages of 8: not all five at once
        sync, over = LLM(path, async_scheduling=False, **knobs, **extra), LLM(path, async_scheduling=True, **knobs, **extra)
        compressed = count_compressions(over)
        (want, pre_sync), (got, pre_over) = outcome(sync), outcome(over)
        assert compressed["tokens"] > 0 and over.engine.async_scheduling
        assert [(len(t), r) for t, r in got] == [(len(t), r) for t, r in want]
        assert len(got[0][0]) <= 31 and len(got[2][0]) <= 46 and len(got[1][0]) == 17
        same = [i for i in range(len(ps)) if i not in pre_sync | pre_over]
        assert [got[i] for i in same] == [want[i] for i in same]
        if extra:
            assert pre_sync and pre_over and len(same) >= 2
        else:
            assert not pre_sync and not pre_over and got == want


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_compression_spread_over_steps_keeps_outputs_when_requests_leave_mid_way(tiny_model, tmp_path,
                                                                                 async_scheduling):
    """A decode-time compression runs a share of the sparse layers a step (deltakv_compress_steps):
    requests that finish while theirs is under way leave it (their pages and raw slots go to the
    requests admitted next, whose latents must not be overwritten), the others' compression goes on.
    With an identity compressor and a keep covering every token DeltaKV equals vanilla, so any
    latent written to the wrong slot or token freed too early changes the tokens."""
    path = tiny_model("llama", num_hidden_layers=8)
    comp = compressor(path, tmp_path / "c", "identity")
    lengths = [70, 61, 90, 66, 75, 83, 58, 95]
    ps = prompts(lengths, seed=21)
    # each request ends 1-4 steps after a decode-time compression of its starts (the tail reaches
    # 2 windows of 16 at comp_end + 32, comp_end from the prompt's own compression)
    knobs = make_config(path, "deltakv", load_format="dummy", **SMALL).method_config
    starts = [knobs.compress_to(4, n) + 32 + 16 * (i % 2) for i, n in enumerate(lengths)]
    params = [SamplingParams(temperature=0.0, max_tokens=t - n + 1 + i % 4, ignore_eos=True)
              for i, (t, n) in enumerate(zip(starts, lengths))]
    want = [o.outputs[0].token_ids for o in LLM(path, device="cpu").generate(ps, params, use_tqdm=False)]
    llm = LLM(path, vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp, deltakv_decode_keep=512,
              deltakv_compress_steps=5, max_num_seqs=3, async_scheduling=async_scheduling, **SMALL)
    cm = llm.engine.cache_manager
    assert cm.spread == 5   # six sparse layers: one or two a step
    cm.allocator.free_clean = MostRecentFirst(cm.allocator.free_clean)
    drops, drop = [], cm._drop
    cm._drop = lambda req: drops.append(req) or drop(req)
    pending = []
    end_step = cm.on_step_end
    cm.on_step_end = lambda step: end_step(step) or pending.append(len(cm.events))
    log = count_compressions(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert got == want
    assert log["tokens"] > 100 and max(pending) >= 1 and drops and not cm.events
    assert cm.allocator.is_idle() and cm.raw_slots.num_free == cm.raw_slots.num_slots and not cm.requests


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_aborted_mid_compression_does_not_write_into_its_old_pages(tiny_model, tmp_path,
                                                                            async_scheduling):
    """A request aborted one step into its decode-time compression: its pages go at once to a longer
    prompt whose own compression covers them; the rest of the aborted request's compression must not
    write its latents there. Identity compressor + a keep covering everything: equal to vanilla."""
    path = tiny_model("llama", num_hidden_layers=8)
    comp = compressor(path, tmp_path / "c", "identity")
    pa, pb, pc = prompts([90, 90, 120], seed=4)   # a and b compress in the same steps, together
    sb, sc = (SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (50, 30))
    want = [o.outputs[0].token_ids for o in LLM(path, device="cpu").generate([pb, pc], [sb, sc], use_tqdm=False)]
    llm = LLM(path, vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp, deltakv_decode_keep=512,
              deltakv_compress_steps=5, max_num_seqs=2, async_scheduling=async_scheduling, **SMALL)
    eng, cm = llm.engine, llm.engine.cache_manager
    cm.allocator.free_clean = MostRecentFirst(cm.allocator.free_clean)
    a = eng.add_request(pa, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    b = eng.add_request(pb, sb)
    under_way = lambda: [e for e in cm.events if any(p[0] is cm.requests.get(a.seq_id) for p in e.plans)]
    while not under_way():
        eng.step()
    event = under_way()[0]
    assert event.layers_done < len(cm.codecs) and len(event.plans) == 2
    eng.abort(a)
    c = eng.add_request(pc, sc)
    while eng.has_work():
        eng.step()
    assert [b.completion_token_ids, c.completion_token_ids] == want
    assert cm.allocator.is_idle() and cm.raw_slots.num_free == cm.raw_slots.num_slots and not cm.events


@pytest.mark.long
def test_compression_shares_follow_the_requests_decode_steps_not_prefills(tiny_model, tmp_path):
    """Prefill steps fall between a compression's shares (two requests at a time, the others admitted
    as they finish), and overlapped scheduling admits a step later: the shares advance on the steps
    that decode the compressing requests, so async on == off token for token."""
    path = tiny_model("llama", num_hidden_layers=8)
    comp = compressor(path, tmp_path / "c", "random", latent=4)
    ps = prompts([130, 130, 3, 64, 300, 130], seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (59, 46, 69, 53, 35, 72)]
    knobs = dict(vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=comp, deltakv_decode_keep=8,
                 deltakv_compress_steps=2, max_num_seqs=2, page_size=8, chunk_prefill_size=256, **SMALL)
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(path, async_scheduling=async_scheduling, **knobs)
        outs.append([o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)])
        assert llm.engine.scheduler.num_preemptions == 0 and not llm.engine.cache_manager.events
    assert outs[0] == outs[1]


# ---------------------------------------------------------------- GPU

@gpu
def test_gpu_deltakv_kernels_match_references_bf16():
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in recon_case(B=3, C=40, S=16, H=8, D=128,
                                                                                 NBR=4, dtype=torch.bfloat16)]
    B, C = args[0].shape
    H, D = args[4].shape[1:]
    outs = []
    for fn in (kd.reconstruct_ref, kd.reconstruct_triton):
        o_k = torch.zeros(B * C, H, D, dtype=torch.bfloat16, device="cuda")
        o_v = torch.zeros_like(o_k)
        fn(*args, o_k, o_v)
        outs.append((o_k.float(), o_v.float()))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=3e-2, rtol=2e-2)
    x = torch.randn(5000, 128, device="cuda", dtype=torch.bfloat16)
    rows = torch.randint(0, 5000, (4, 2048), device="cuda", dtype=torch.int32)
    w = torch.randn(2048, 128, device="cuda", dtype=torch.bfloat16) / 11
    b = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(kd.gather_linear_triton(x, rows, w, b).float(), kd.gather_linear_ref(x, rows, w, b).float(),
                               atol=3e-2, rtol=2e-2)
    k, v, slots, cos_sin = [t.cuda() for t in pool_case(500, 8, 128, dtype=torch.bfloat16)]
    pos = torch.arange(500, device="cuda")
    torch.testing.assert_close(kd.gather_x_triton(k, v, slots, pos, cos_sin), kd.gather_x_ref(k, v, slots, pos, cos_sin),
                               atol=2e-2, rtol=2e-2)


@gpu
def test_gpu_deltakv_graph_replay_equals_eager(tiny_model, tmp_path):
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "random", latent=8)
    ps = prompts([300, 90, 500, 41], seed=8)
    knobs = dict(vllm_sparse_method="deltakv", device="cuda", dtype="float32", deltakv_compressor_path=comp,
                 deltakv_decode_keep=20, **SMALL)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    eager = LLM(path, enforce_eager=True, **knobs)
    graph = LLM(path, **knobs)
    assert graph.execution_mode == "cuda_graph"
    assert run(graph, ps, sp) == run(eager, ps, sp)


@gpu
def test_gpu_deltakv_equals_vanilla_with_identity_compressor(tiny_model, tmp_path):
    path = model(tiny_model)
    comp = compressor(path, tmp_path / "c", "identity")
    ps = prompts([300, 170, 45, 600], seed=9)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = run(LLM(path, device="cuda", dtype="float32"), ps, sp)
    got = run(LLM(path, vllm_sparse_method="deltakv", device="cuda", dtype="float32", deltakv_compressor_path=comp,
                  deltakv_decode_keep=1024, **SMALL), ps, sp)
    assert got == want


@gpu
def test_gpu_deltakv_dummy_compressor_bf16_graphs_free_raw_slots(tiny_model):
    """load_format="dummy" builds a random compressor of the configured shape; the bf16 engine with
    graphs runs batch 3 over compressed contexts (chunked prefill included) and returns every slot."""
    path = model(tiny_model)
    llm = LLM(path, vllm_sparse_method="deltakv", device="cuda", load_format="dummy", chunk_prefill_size=128,
              deltakv_decode_keep=64, **SMALL)
    assert llm.execution_mode == "cuda_graph"
    cm = llm.engine.cache_manager
    used = []
    on_step_end = cm.on_step_end

    def logged(step):
        on_step_end(step)
        used.append(cm.memory_accounting()["used_raw_slots"])
    cm.on_step_end = logged
    outs = run(llm, prompts([700, 650, 90], seed=10), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    assert all(len(o) == 50 for o in outs)
    assert max(used) < (700 + 650) / 2


@gpu
def test_gpu_decode_time_compression_never_waits_for_the_device(tiny_model, tmp_path):
    """A decode step's compression work (planning, a share of the layers, marking the tokens
    compressed) only queues device work: a synchronising call there would stall overlapped
    scheduling (a scalar index_put from host memory cost ~12 ms a 128K x 4 step on the H200)."""
    path = tiny_model("llama", num_hidden_layers=8)
    comp = compressor(path, tmp_path / "c", "random", latent=8)
    llm = LLM(path, vllm_sparse_method="deltakv", device="cuda", deltakv_compressor_path=comp, deltakv_decode_keep=20,
              deltakv_compress_steps=3, **SMALL)
    cm, under_way = llm.engine.cache_manager, []
    on_step_end = cm.on_step_end

    def strict(step):
        if step.is_prefill:
            return on_step_end(step)
        torch.cuda.set_sync_debug_mode("error")
        try:
            on_step_end(step)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        under_way.append(len(cm.events))
    cm.on_step_end = strict
    outs = run(llm, prompts([300, 90, 140], seed=2), SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    assert all(len(o) == 60 for o in outs) and max(under_way) >= 1
