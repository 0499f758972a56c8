"""vllm_sparse_method="auto" under memory pressure: a decode step short of pages compacts a running
request's KV (SnapKV-style, engine/cache_manager/pressure.py) instead of preempting and recomputing
one. Four long requests in a pool that admits two: all finish, nothing is prefilled twice, nobody is
preempted, allocators end idle, metrics["sparse"]["compacted"] says so. A compacted request's later
tokens equal no launched engine's, so they are checked by finishing and the pool's accounting; with
auto_compact_on_pressure=False the old preemption (recompute) is unchanged. Overlap off and on.
"""
import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from method_knobs import METHOD_KNOBS  # noqa: E402
from sparsevllm import LLM, SamplingParams  # noqa: E402
from sparsevllm.method_registry import make_config  # noqa: E402

BASE = dict(page_size=4, max_model_len=512, max_num_seqs=16)
AUTO = dict(auto_dense_below=120, quest_token_budget=16, quest_skip_layers=1)
GEN = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
PROMPT = 200
# Two prompts of 200 tokens (51 pages each at admission) fit; their 48 output tokens (62 pages each) do not.
PAGES = 110


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, PROMPT).tolist() for _ in range(n)]


def run(llm, ps):
    """Generate; also count the prompt tokens every prefill step ran."""
    eng = llm.engine
    prefilled = []
    real = eng.scheduler._schedule_prefill

    def counted():
        batch = real()
        prefilled.extend(batch.num_tokens)
        return batch
    eng.scheduler._schedule_prefill = counted
    outs = llm.generate(ps, GEN, use_tqdm=False)
    assert eng.cache_manager.allocator.is_idle()
    return outs, sum(prefilled)


@pytest.mark.parametrize("overlap", [False, True])
def test_auto_compacts_instead_of_preempting(tiny_model, overlap):
    model = tiny_model(num_hidden_layers=3)
    llm = LLM(model, "auto", **BASE, **AUTO, num_kv_pages=PAGES, auto_compact_capacity=48, async_scheduling=overlap)
    ps = prompts(4)
    outs, prefilled = run(llm, ps)
    sched = llm.engine.scheduler
    assert sched.num_preemptions == 0 and sched.num_pressure_compactions > 0
    assert prefilled == 4 * PROMPT   # no request was prefilled (recomputed) again
    assert all(len(o.outputs[0].token_ids) == GEN.max_tokens and o.outputs[0].finish_reason == "length"
               for o in outs)
    compacted = [o.metrics["sparse"]["compacted"] for o in outs if "compacted" in o.metrics["sparse"]]
    assert len(compacted) == sched.num_pressure_compactions
    for c, o in zip(compacted, [o for o in outs if "compacted" in o.metrics["sparse"]]):
        assert c["tokens_after"] == 48 and c["tokens_before"] > 48 and 0 < c["at_output_token"] < GEN.max_tokens
        assert o.metrics["sparse"]["method"] == "vanilla"   # a dense row over its kept tokens from then on


@pytest.mark.parametrize("case", ["omnikv", "mixed"])
def test_auto_compacts_with_other_methods(tiny_model, case):
    """auto_method=omnikv, and an "auto" engine hosting snapkv too (mixed_methods: the composite's
    shared pool and routing; a compacted row leaves its method for the dense rows)."""
    model = tiny_model(num_hidden_layers=3)
    knobs = (dict(auto_dense_below=120, auto_method="omnikv", **METHOD_KNOBS["omnikv"]) if case == "omnikv" else
             dict(AUTO, mixed_methods=["snapkv"], **METHOD_KNOBS["snapkv"]))
    llm = LLM(model, "auto", **BASE, **knobs, num_kv_pages=PAGES, auto_compact_capacity=48)
    outs, prefilled = run(llm, prompts(4))
    sched = llm.engine.scheduler
    assert sched.num_preemptions == 0 and sched.num_pressure_compactions > 0 and prefilled == 4 * PROMPT
    assert sum("compacted" in o.metrics["sparse"] for o in outs) == sched.num_pressure_compactions
    assert all(len(o.outputs[0].token_ids) == GEN.max_tokens for o in outs)


def test_auto_without_compaction_preempts_and_recomputes_as_before(tiny_model):
    """Knob off: preemption by recompute, as on main. Every request is a dense row here
    (auto_dense_below above the prompts), so recompute is exact: tokens equal a pool with room."""
    model = tiny_model(num_hidden_layers=3)
    knobs = dict(AUTO, auto_dense_below=1000)
    ps = prompts(4)
    tight = LLM(model, "auto", **BASE, **knobs, num_kv_pages=PAGES, auto_compact_on_pressure=False)
    outs, prefilled = run(tight, ps)
    assert tight.engine.scheduler.num_preemptions > 0 and tight.engine.scheduler.num_pressure_compactions == 0
    assert prefilled > 4 * PROMPT
    roomy = LLM(model, "auto", **BASE, **knobs)
    want, _ = run(roomy, ps)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert all("compacted" not in o.metrics["sparse"] for o in outs)


def test_auto_pressure_knobs_are_validated():
    with pytest.raises(ValueError, match="auto_compact_capacity=32 is invalid; valid: an integer > 32"):
        make_config(None, "auto", auto_compact_capacity=32)
    with pytest.raises(ValueError, match="auto_compact_capacity='big' is invalid"):
        make_config(None, "auto", auto_compact_capacity="big")
    with pytest.raises(ValueError, match="auto_compact_on_pressure='yes' is invalid; valid: True or False"):
        make_config(None, "auto", auto_compact_on_pressure="yes")
    with pytest.raises(ValueError, match="knob 'auto_compact_capacity' belongs to vllm_sparse_method='auto'"):
        make_config(None, "quest", auto_compact_capacity=64)
