"""What tests/test_per_request.py and tests/test_mixed_methods.py share: the engine size, greedy
decoding, a second budget per method, and a request run alone in an engine launched
with its method and knobs (the reference every mixed batch is compared with)."""
from sparsevllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BASE = dict(page_size=4, max_model_len=512, max_num_seqs=16)
# A second budget per method, below the engine's, that a request asks for (sparser than its neighbours).
OTHER = {"quest": dict(quest_token_budget=16), "omnikv": dict(omnikv_num_selected=8),
         "snapkv": dict(snapkv_capacity=24)}


def alone(model, method, knobs, prompt, gen=GREEDY, **engine):
    """The request alone, in an engine launched with its method and knobs; its pool ends idle."""
    llm = LLM(model, method, **BASE, **knobs, **engine)
    out = llm.generate([prompt], gen, use_tqdm=False)[0]
    assert llm.engine.cache_manager.allocator.is_idle()
    return out.outputs[0].token_ids


def run_noting_preemptions(llm, ps, gen, sparse):
    """Run the prompts with their SparseParams through llm's engine; return the sequences and the
    ids of those the scheduler preempted (recomputed) on the way. The pool ends idle."""
    preempted = set()
    real = llm.engine.scheduler.preempt

    def preempt(seq):
        preempted.add(seq.seq_id)
        real(seq)
    llm.engine.scheduler.preempt = preempt
    seqs = [llm.engine.add_request(p, gen, sparse=s) for p, s in zip(ps, sparse)]
    llm.engine.run(seqs, use_tqdm=False)
    assert llm.engine.cache_manager.allocator.is_idle()
    return seqs, preempted
