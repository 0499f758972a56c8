"""Task generators, length targeting, fidelity samples, LongBench datasets and graders of the
regression harness. No engine and no model: a small BPE tokenizer stands in for the model's."""

import json
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from regression_fixtures import build_tokenizer  # noqa: E402

from sparsevllm.regression.datasets import dataset_samples, parse_dataset_spec  # noqa: E402
from sparsevllm.regression.fidelity import compare, fidelity_sample, _token_stream  # noqa: E402
from sparsevllm.regression.grading import normalize, score  # noqa: E402
from sparsevllm.regression.prompts import PromptFormatter  # noqa: E402
from sparsevllm.regression.tasks import DEPTHS, SYNTHETIC_TASKS  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def formatter(tokenizer):
    return PromptFormatter(tokenizer, use_chat_template=True)


@pytest.mark.parametrize("task", sorted(SYNTHETIC_TASKS))
def test_generator_is_deterministic_and_seed_dependent(formatter, task):
    gen = SYNTHETIC_TASKS[task]
    a, b = gen(formatter, 1024, 3, seed=7), gen(formatter, 1024, 3, seed=7)
    assert a.prompt_token_ids == b.prompt_token_ids and a.answers == b.answers
    assert a.prompt_hash == b.prompt_hash
    other = gen(formatter, 1024, 3, seed=8)
    assert other.prompt_hash != a.prompt_hash


@pytest.mark.parametrize("task", sorted(SYNTHETIC_TASKS))
@pytest.mark.parametrize("length", [512, 2048])
def test_prompt_length_is_measured_and_just_under_target(formatter, tokenizer, task, length):
    for index in range(3):
        s = SYNTHETIC_TASKS[task](formatter, length, index, seed=0)
        assert s.prompt_token_ids == tokenizer(s.prompt, add_special_tokens=False)["input_ids"]
        # Within one filler sentence (essay sentences reach ~300 characters) of the target.
        assert length - 96 <= len(s.prompt_token_ids) <= length
        assert s.meta["prompt_tokens"] == len(s.prompt_token_ids)


@pytest.mark.parametrize("task", sorted(SYNTHETIC_TASKS))
def test_every_answer_is_recoverable_by_string_search_once(formatter, tokenizer, task):
    for index in range(5):
        s = SYNTHETIC_TASKS[task](formatter, 1024, index, seed=1)
        text = tokenizer.decode(s.prompt_token_ids)
        assert text == s.prompt
        if task == "variable_tracking":
            value = s.meta["value"]
            assert text.count(f"VAR {s.answers[0]} = {value}.") == 1
            for prev, name in zip(s.answers, s.answers[1:]):
                assert text.count(f"VAR {name} = {prev}.") == 1
            assert text.count("VAR ") == len(s.answers)
        else:
            for value in s.answers:
                assert text.count(value) == 1, value
                assert text.count(f"for {s.meta['key']} is: {value}.") == 1
            # Distractor needles exist, under other keys, exactly once each.
            assert text.count("One of the special magic") == s.meta["num_keys"] - 1 + len(s.answers)
        # The question is stated before and after the haystack; the prompt ends with the
        # assistant's answer prefix.
        question = ("directly or through other variables?" if task == "variable_tracking"
                    else f"for {s.meta['key']} mentioned in the provided text?")
        assert text.count(question) == 2
        assert "<|im_start|>assistant\n" in text


def test_single_needle_sits_at_its_depth(formatter):
    for index, depth in enumerate(DEPTHS):
        s = SYNTHETIC_TASKS["niah_single_number_noise"](formatter, 2048, index, seed=0)
        assert s.meta["depths"] == [depth]
        start = s.prompt.index("grass")  # the haystack's first sentence
        end = s.prompt.rindex("again.") + len("again.")
        at = s.prompt.index(s.answers[0])
        assert abs((at - start) / (end - start) - depth) < 0.03


def test_prompt_without_chat_template_starts_with_bos(tokenizer):
    plain = PromptFormatter(tokenizer, use_chat_template=False)
    s = SYNTHETIC_TASKS["niah_single_number_noise"](plain, 512, 0, seed=0)
    assert "<|im_start|>" not in s.prompt
    assert s.prompt.endswith("mentioned in the provided text is")
    assert len(s.prompt_token_ids) <= 512
    bos = tokenizer("", add_special_tokens=True)["input_ids"]
    assert s.prompt_token_ids[:len(bos)] == bos


def test_length_shorter_than_the_task_prompt_is_a_value_error(formatter):
    with pytest.raises(ValueError, match="--lengths"):
        SYNTHETIC_TASKS["niah_multivalue"](formatter, 40, 0, seed=0)


def test_fidelity_sample_is_an_exact_slice_of_the_docs(tokenizer):
    s = fidelity_sample(tokenizer, 700, 2, seed=0, num_tokens=24)
    assert len(s.prompt_token_ids) == 700 and len(s.continuation_ids) == 24
    stream = _token_stream(tokenizer)
    special = tokenizer("", add_special_tokens=True)["input_ids"]
    start = s.meta["start_token"]
    assert s.prompt_token_ids == special + stream[start:start + 700 - len(special)]
    assert s.continuation_ids == stream[start + 700 - len(special):start + 700 - len(special) + 24]
    assert fidelity_sample(tokenizer, 700, 2, seed=0, num_tokens=24).prompt_hash == s.prompt_hash


def test_fidelity_compare_identical_and_shifted_distributions():
    torch.manual_seed(0)
    ref = torch.log_softmax(torch.randn(5, 50), -1)
    target = ref.argmax(-1).tolist()
    same = compare(ref, ref.clone(), target)
    assert same["top1_agreement"] == 1.0 and abs(same["kl"]) < 1e-6 and same["text_top1"] == 1.0
    # A method that flips every argmax: agreement 0, KL equal to the closed form.
    other = torch.log_softmax(torch.randn(5, 50), -1)
    worse = other.clone()
    worse[torch.arange(5), target] = -30.0
    got = compare(ref, worse, target)
    assert got["top1_agreement"] < 1.0
    worse_normalized = worse - worse.logsumexp(-1, keepdim=True)  # compare() renormalizes
    expected_kl = (ref.exp() * (ref - worse_normalized)).sum(-1).mean().item()
    assert got["kl"] == pytest.approx(expected_kl, rel=1e-5)
    with pytest.raises(ValueError, match="shapes"):
        compare(ref, ref[:3], target)


@pytest.mark.parametrize("metric,output,answers,expected", [
    ("contains", " 1234567.", ["1234567"], 1.0),
    ("contains", " 1234568.", ["1234567"], 0.0),
    ("contains", "The answer is KITTEN", ["kitten"], 1.0),
    ("contains_all", "AAA, BBB and CCC", ["AAA", "BBB", "CCC", "DDD"], 0.75),
    ("contains_all", "nothing", ["AAA", "BBB"], 0.0),
    ("exact", "The Eiffel Tower!", ["eiffel tower"], 1.0),
    ("exact", "Eiffel Tower in Paris", ["eiffel tower"], 0.0),
    ("f1", "the cat sat", ["a cat sat down"], 0.8),
    ("f1", "dog", ["cat", "dog"], 1.0),
    ("f1", "", ["cat"], 0.0),
    ("rouge_l", "the cat sat on the mat", ["the cat lay on the mat"], 0.75),
    ("rouge_l", "x y z", ["a b"], 0.0),
])
def test_graders_score_known_cases(metric, output, answers, expected):
    assert score(metric, output, answers) == pytest.approx(expected)


def test_grader_rejects_unknown_metric_and_empty_answers():
    with pytest.raises(ValueError, match="metric"):
        score("bleu", "x", ["x"])
    with pytest.raises(ValueError, match="reference"):
        score("f1", "x", [])
    assert normalize("  The  Quick, brown fox. ") == "quick brown fox"


def _write_longbench(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_longbench_jsonl_is_middle_truncated_to_each_length(tmp_path, formatter, tokenizer):
    long_context = " ".join(f"Sentence number {i} is here." for i in range(2000))
    path = tmp_path / "toy.jsonl"
    _write_longbench(path, [
        {"context": "START " + long_context + " END", "input": "Where?", "answers": ["here"],
         "length": 14000, "_id": "a"},
        {"context": "short text", "input": "", "answers": "short"},
        {"context": "never read", "input": "q", "answers": ["x"]},
    ])
    label, p, metric = parse_dataset_spec(f"{path}:rouge_l")
    assert (label, p, metric) == ("toy", str(path), "rouge_l")
    samples = dataset_samples(label, p, metric, formatter, 512, num_samples=2)
    assert len(samples) == 2
    long, short = samples
    assert long.meta["truncated"] and len(long.prompt_token_ids) <= 512
    assert len(long.prompt_token_ids) >= 500
    assert "START" in long.prompt and "END" in long.prompt  # the middle is what was cut
    assert long.prompt.count("Where?") == 2 and long.meta["id"] == "a"
    assert not short.meta["truncated"] and "summarize" in short.prompt
    assert short.answers == ["short"]


def test_dataset_spec_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        parse_dataset_spec(str(tmp_path / "missing.jsonl"))
    (tmp_path / "d.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="metric"):
        parse_dataset_spec(f"{tmp_path / 'd.jsonl'}:bleu")
    formatter = PromptFormatter(build_tokenizer(256), True)
    with pytest.raises(ValueError, match="context"):
        dataset_samples("d", str(tmp_path / "d.jsonl"), "f1", formatter, 256, 5)


@pytest.mark.parametrize("line, says", [('{"context": "a", "answers": ["b"]', "not a JSON line"),
                                        ('["a", "b"]', "is a JSON object, got list"),
                                        ('{"context": 3, "answers": ["b"]}', "needs a string 'context'")])
def test_a_bad_longbench_line_is_named_by_file_and_line(tmp_path, line, says):
    from sparsevllm.regression.datasets import load_jsonl
    path = tmp_path / "qa.jsonl"
    path.write_text('{"context": "x", "answers": "y"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=f"qa.jsonl:3: .*{re.escape(says)}"):
        load_jsonl(str(path), 10)
