"""Sampling: greedy, temperature, top-k and top-p draw from the right distribution; seeds make a
request reproducible whatever else shares its batch."""
import torch

from sparsevllm import LLM, SamplingParams
from sparsevllm.layers.sampler import sample


def draw(logits, sp, n=4000):
    g = torch.Generator().manual_seed(0)
    rows = logits.expand(n, -1).contiguous()
    return sample(rows, [sp] * n, [None] * n, g)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    assert sample(logits, [SamplingParams(temperature=0.0)], [None], torch.Generator()).item() == 1


def test_temperature_sampling_matches_softmax_frequencies():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    freq = torch.bincount(draw(logits, SamplingParams(temperature=0.7)), minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[0] / 0.7, 0), atol=0.03, rtol=0)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[0.0, 1.0, 2.0, 1.5, -1.0]])
    assert set(draw(logits, SamplingParams(top_k=2)).tolist()) == {2, 3}
    probs = torch.softmax(logits[0], 0)  # sorted: 2 (.44), 3 (.27), 1 (.16) ...
    assert set(draw(logits, SamplingParams(top_p=0.6)).tolist()) == {2, 3}
    assert probs[2] < 0.6


def test_seeded_requests_are_reproducible_across_batches(tiny_model):
    llm = LLM(tiny_model("llama"))
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate([[9, 9, 9], [5, 6, 7, 8], [1, 2]], [other, sp, other], use_tqdm=False)[1].outputs[0].token_ids
    assert alone == batched
    unseeded = llm.generate([[5, 6, 7, 8]] * 3, other, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) > 1
