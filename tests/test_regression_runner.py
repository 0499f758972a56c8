"""The regression runner: method variants, scoring against vanilla, resumption, reports; then a
smoke run through the real engine with a tiny random model, and (slow) a short SmolLM2 run."""

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from sparsevllm.outputs import CompletionOutput, RequestOutput

sys.path.insert(0, os.path.dirname(__file__))
from regression_fixtures import build_tiny_llama, build_tokenizer  # noqa: E402

from sparsevllm.regression import runner as runner_module  # noqa: E402
from sparsevllm.regression.__main__ import main, parse_args  # noqa: E402
from sparsevllm.regression.runner import RunConfig, Runner, build_samples  # noqa: E402
from sparsevllm.regression.variants import expand_variants  # noqa: E402

ARTIFACTS = ("samples.jsonl", "summary.json", "summary.md", "run.json", "accuracy_vs_length.png")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


class FakeLLM:
    """Stands in for `LLM`: answers from the generated samples' references. `budget=1` plays a
    lossy method: it forgets the answer of every even-indexed sample and perturbs its log-probs."""

    def __init__(self, answers: dict, vocab: int, calls: list, method: str, knobs: dict):
        self.answers, self.vocab, self.calls = answers, vocab, calls
        self.lossy = method != "vanilla" and knobs.get("lossy_budget") == 1
        self.recall = bool(knobs.get("recall_sample_every"))   # the engine's attention-recall telemetry

    def shutdown(self):
        pass

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", len(prompts)))
        outs = []
        for ids, sp in zip(prompts, params):
            assert sp.temperature == 0.0
            answers, index = self.answers[tuple(ids)]
            text = "I do not know." if self.lossy and index % 2 == 0 else " " + ", ".join(answers)
            metrics = {"arrival_time": 0.0, "first_token_time": 0.5, "finish_time": 1.0, "token_times": [0.5, 1.0]}
            if self.recall:
                metrics["attention_recall"] = {"mean": 0.5 if self.lossy else 1.0, "sampled_steps": 1}
            outs.append(RequestOutput(
                request_id=str(index), prompt=None, prompt_token_ids=ids, prompt_logprobs=None,
                outputs=[CompletionOutput(0, text, [1, 2], None, None, "stop")], finished=True,
                metrics=metrics))
        return outs

    def teacher_forced_logprobs(self, prompts, continuations, use_tqdm=True):
        self.calls.append(("teacher_forced", len(prompts)))
        rows = []
        for ids, cont in zip(prompts, continuations):
            g = torch.Generator().manual_seed(sum(ids) % 10_000)
            logits = torch.randn(len(cont), self.vocab, generator=g) * 3
            if self.lossy:
                logits = logits + torch.randn(len(cont), self.vocab) * 3
            rows.append(torch.log_softmax(logits, -1))
        return rows


def _fake_runner(config, tokenizer, calls, monkeypatch):
    monkeypatch.setattr(runner_module, "_greedy",
                        lambda n: SimpleNamespace(temperature=0.0, max_tokens=n))
    answers = {tuple(s.prompt_token_ids): (s.answers, s.index)
               for s in build_samples(tokenizer, config)}

    def factory(model, method, knobs):
        return FakeLLM(answers, len(tokenizer), calls, method, knobs)

    return Runner(config, llm_factory=factory, tokenizer=tokenizer)


def _config(out_dir, **overrides):
    base = dict(methods=["lossy"], tasks=["niah_single_number_noise", "niah_multivalue", "fidelity"],
                lengths=[512, 768], samples=4, out_dir=str(out_dir),
                hyper_params={"max_num_seqs": 4, "lossy": {"lossy_budget": [1, 2]}},
                fidelity_tokens=8)
    base.update(overrides)
    return RunConfig(**base)


def test_each_requests_attention_recall_is_kept_and_averaged_per_cell(tmp_path, tokenizer, monkeypatch):
    config = _config(tmp_path, tasks=["niah_single_number_noise"], lengths=[512], samples=2,
                     hyper_params={"recall_sample_every": 4, "lossy": {"lossy_budget": [1, 2]}})
    summary = _fake_runner(config, tokenizer, [], monkeypatch).run()
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert all(r["attention_recall"]["sampled_steps"] == 1 for r in records)
    recall = {c["label"]: c["attention_recall"] for c in summary["cells"]}
    assert recall == {"vanilla": 1.0, "lossy[lossy_budget=1]": 0.5, "lossy[lossy_budget=2]": 1.0}


def test_runner_scores_against_vanilla_and_writes_every_artifact(tmp_path, tokenizer, monkeypatch):
    calls = []
    summary = _fake_runner(_config(tmp_path), tokenizer, calls, monkeypatch).run()
    for name in ARTIFACTS + ("accuracy_vs_budget.png",):
        assert (tmp_path / name).stat().st_size > 0, name
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 3 * 2 * 4  # variants x tasks x lengths x samples
    for r in records:
        assert {"prompt_hash", "expected", "output", "score", "latency_s", "prompt_tokens"} <= set(r)
        assert r["error"] is None and r["prompt_tokens"] <= r["length"]
    cells = {(c["label"], c["task"], c["length"]): c for c in summary["cells"]}
    for task in ("niah_single_number_noise", "niah_multivalue"):
        for n in (512, 768):
            assert cells[("vanilla", task, n)]["accuracy"] == 100.0
            assert cells[("lossy[lossy_budget=2]", task, n)]["pass"]
            lossy = cells[("lossy[lossy_budget=1]", task, n)]
            assert lossy["accuracy"] == 50.0 and lossy["drop"] == 50.0 and not lossy["pass"]
    exact = cells[("lossy[lossy_budget=2]", "fidelity", 512)]
    assert exact["accuracy"] == 100.0 and exact["kl"] < 1e-3  # only the float16 storage noise
    noisy = cells[("lossy[lossy_budget=1]", "fidelity", 512)]
    assert noisy["accuracy"] < 100.0 and noisy["kl"] > 0.1
    assert summary["overall"]["vanilla"]["pass"] and not summary["pass"]
    assert summary["protocol"]["chat_template"] is True
    md = (tmp_path / "summary.md").read_text()
    assert "lossy[lossy_budget=1]" in md and "50.0 (-50.0) FAIL" in md and "greedy" in md
    assert summary["protocol"]["filler_text"].startswith("CPython 3.")   # prose differs by version
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "complete"
    # Whole cells are batched: one generate() call per variant x task x length.
    assert ("generate", 4) in calls and ("teacher_forced", 4) in calls


def test_rerun_skips_finished_samples_and_redoes_missing_ones(tmp_path, tokenizer, monkeypatch):
    calls = []
    config = _config(tmp_path, methods=[], hyper_params={}, tasks=["niah_single_word_noise"])
    _fake_runner(config, tokenizer, calls, monkeypatch).run()
    assert sum(n for _, n in calls) == 8
    calls.clear()
    _fake_runner(config, tokenizer, calls, monkeypatch).run()
    assert calls == []  # everything was done: no LLM is even built
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    (tmp_path / "samples.jsonl").write_text("\n".join(lines[:5]) + "\n")
    summary = _fake_runner(config, tokenizer, calls, monkeypatch).run()
    assert sum(n for _, n in calls) == 3
    assert all(c["scored"] == 4 for c in summary["cells"])


def test_resume_after_a_line_cut_mid_write_loses_no_new_record(tmp_path, tokenizer, monkeypatch):
    calls = []
    config = _config(tmp_path, methods=[], hyper_params={}, tasks=["niah_single_word_noise"])
    _fake_runner(config, tokenizer, calls, monkeypatch).run()
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    # killed while writing the sixth record: no newline after the fragment
    (tmp_path / "samples.jsonl").write_text("\n".join(lines[:5]) + "\n" + lines[5][:30])
    calls.clear()
    summary = _fake_runner(config, tokenizer, calls, monkeypatch).run()
    assert sum(n for _, n in calls) == 3
    assert all(c["scored"] == 4 and c["missing"] == 0 for c in summary["cells"]) and summary["pass"]
    calls.clear()
    _fake_runner(config, tokenizer, calls, monkeypatch).run()
    assert calls == []  # the rerun samples were kept, not lost behind the fragment


def test_a_drop_of_exactly_the_tolerance_passes():
    from sparsevllm.regression import report
    from sparsevllm.regression.prompts import Sample
    variants = expand_variants(["quest"], {}, registered=None)
    samples = [Sample("t", 512, i, "", [i], ["x"], "contains", 4) for i in range(20)]
    key = lambda v, s: f"{v.label}|{s.index}"  # noqa: E731
    # vanilla 11/20 = 55%, quest 10/20 = 50%: one sample, exactly the 5-point tolerance
    records = {key(v, s): {"score": float(s.index < (11 if v.method == "vanilla" else 10)),
                           "error": None} for v in variants for s in samples}
    summary = report.summarize(RunConfig(tolerance=5.0), variants, samples, records, key, True)
    cell = next(c for c in summary["cells"] if c["label"] == "quest")
    assert cell["drop"] == 5.0 and cell["pass"] and summary["pass"]


def test_budget_plot_has_a_line_for_each_method_sweeping_its_own_knob(tmp_path, monkeypatch):
    import matplotlib.axes

    from sparsevllm.regression import report
    from sparsevllm.regression.prompts import Sample
    # the README's sweep: quest over quest_token_budget, snapkv over snapkv_capacity
    variants = expand_variants(["quest", "snapkv"], {"quest": {"quest_token_budget": [256, 512]},
                                                     "snapkv": {"snapkv_capacity": [256, 512]}},
                               registered=None)
    samples = [Sample("t", 512, 0, "", [0], ["x"], "contains", 4)]
    key = lambda v, s: v.label  # noqa: E731
    records = {v.label: {"score": 1.0, "error": None} for v in variants}
    summary = report.summarize(RunConfig(), variants, samples, records, key, True)
    lines, real_plot = [], matplotlib.axes.Axes.plot

    def plot(self, *args, **kwargs):
        lines.append((kwargs.get("label"), args))
        return real_plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    report.plot(summary, str(tmp_path))
    budget = {label: args for label, args in lines if label in ("quest @ 512", "snapkv @ 512")}
    assert budget["snapkv @ 512"] == ((256, 512), (100.0, 100.0))
    assert budget["quest @ 512"] == ((256, 512), (100.0, 100.0))


def test_rerun_with_another_dataset_metric_regrades(tmp_path, tokenizer, monkeypatch):
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"context": "The capital of France is Paris. " * 40,
                                "input": "Capital of France?", "answers": ["Paris"]}) + "\n")
    calls = []
    config = _config(tmp_path / "out", methods=[], hyper_params={}, tasks=[f"{data}:exact"],
                     lengths=[512], samples=1)
    summary = _fake_runner(config, tokenizer, calls, monkeypatch).run()
    assert summary["cells"][0]["accuracy"] == 100.0  # the fake answers " Paris"
    config.tasks = [f"{data}:rouge_l"]
    calls.clear()
    summary = _fake_runner(config, tokenizer, calls, monkeypatch).run()
    assert calls == [("generate", 1)] and summary["cells"][0]["metric"] == "rouge_l"
    data.write_text(json.dumps({"context": "The capital of France is Paris. " * 40,
                                "input": "Capital of France?", "answers": ["Lyon"]}) + "\n")
    calls.clear()
    summary = _fake_runner(config, tokenizer, calls, monkeypatch).run()
    assert calls == [("generate", 1)]  # corrected answers are graded again


def test_fidelity_reference_is_recomputed_when_its_file_is_gone(tmp_path, tokenizer, monkeypatch):
    calls = []
    config = _config(tmp_path, tasks=["fidelity"], lengths=[512], samples=2)
    _fake_runner(config, tokenizer, calls, monkeypatch).run()
    for f in (tmp_path / "fidelity_reference").iterdir():
        f.unlink()
    calls.clear()
    summary = _fake_runner(config, tokenizer, calls, monkeypatch).run()
    assert calls == [("teacher_forced", 2)]  # vanilla again; the methods' records stand
    assert all(c["scored"] == 2 for c in summary["cells"])


def test_engine_errors_are_recorded_not_fatal_and_retried(tmp_path, tokenizer, monkeypatch):
    calls = []
    config = _config(tmp_path, methods=["broken"], hyper_params={}, tasks=["niah_single_number_noise"],
                     lengths=[512], samples=2)
    runner = _fake_runner(config, tokenizer, calls, monkeypatch)
    good = runner.llm_factory

    def factory(model, method, knobs):
        if method == "broken":
            raise ValueError("unknown knob")
        return good(model, method, knobs)

    runner.llm_factory = factory
    summary = runner.run()
    cell = next(c for c in summary["cells"] if c["label"] == "broken")
    assert cell["errors"] == 2 and not cell["pass"] and cell["accuracy"] is None
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["status"] == "failed" and "unknown knob" in run["errors"][0]
    calls.clear()
    runner.llm_factory = good
    summary = runner.run()
    assert calls == [("generate", 2)] and summary["pass"]


def test_hyper_params_route_shared_per_method_and_swept_knobs():
    variants = expand_variants(
        ["quest", "snapkv"],
        {"max_num_seqs": 8, "quest_token_budget": 512, "snapkv": {"snapkv_capacity": [64, 128]}},
        registered=["vanilla", "quest", "snapkv"])
    by_label = {v.label: v for v in variants}
    assert list(by_label) == ["vanilla", "quest", "snapkv[snapkv_capacity=64]",
                              "snapkv[snapkv_capacity=128]"]
    assert by_label["vanilla"].knobs == {"max_num_seqs": 8}  # method-prefixed knobs stay away
    assert by_label["quest"].knobs == {"max_num_seqs": 8, "quest_token_budget": 512}
    assert by_label["snapkv[snapkv_capacity=128]"].knobs == {"max_num_seqs": 8,
                                                             "snapkv_capacity": 128}
    assert all(v.reference == "vanilla" for v in variants)
    assert len({v.variant_id for v in variants}) == 4


def test_a_list_valued_knob_is_one_setting_and_a_list_of_lists_sweeps_it(tmp_path):
    layers = {"omnikv": {"omnikv_filter_layers": [2, 8, 17], "omnikv_num_selected": [64, 128]}}
    runner = Runner(RunConfig(methods=["omnikv"], hyper_params=layers, out_dir=str(tmp_path)),
                    llm_factory=lambda *a: None, tokenizer=object())
    omni = [v for v in runner.variants if v.method == "omnikv"]
    assert [v.knobs["omnikv_filter_layers"] for v in omni] == [[2, 8, 17], [2, 8, 17]]
    assert [v.sweep for v in omni] == [{"omnikv_num_selected": 64}, {"omnikv_num_selected": 128}]
    sweep = {"deltakv": {"deltakv_full_layers": [[0, 1], None]}}
    runner = Runner(RunConfig(methods=["deltakv"], hyper_params=sweep, out_dir=str(tmp_path)),
                    llm_factory=lambda *a: None, tokenizer=object())
    assert [v.knobs.get("deltakv_full_layers") for v in runner.variants] == [None, [0, 1], None]


def test_hyper_params_errors_name_the_argument():
    with pytest.raises(ValueError, match="--methods.*bogus"):
        expand_variants(["bogus"], {}, registered=["vanilla", "quest"])
    with pytest.raises(ValueError, match="--hyper_params.*quest"):
        expand_variants(["quest"], {"quest": 5}, registered=["vanilla", "quest"])
    for knobs in ({"snapkv": {"snapkv_capacity": [64]}}, {"snapkv_capacity": [64]}):
        with pytest.raises(ValueError, match="--hyper_params: 'snapkv.*not in --methods"):
            expand_variants(["quest"], knobs, registered=["vanilla", "quest", "snapkv"])
    with pytest.raises(ValueError, match="empty list"):
        expand_variants(["quest"], {"quest": {"quest_token_budget": []}}, registered=None)
    with pytest.raises(ValueError, match="--tasks"):
        Runner(RunConfig(tasks=["no_such_task"]), llm_factory=lambda *a: None, tokenizer=object())


def test_bad_knobs_are_rejected_before_vanilla_runs(tmp_path):
    with pytest.raises(ValueError, match=r"--hyper_params: quest\[.*quest_token_budgt"):
        Runner(RunConfig(methods=["quest"], hyper_params={"quest": {"quest_token_budgt": [256]}},
                         out_dir=str(tmp_path)), tokenizer=object())
    with pytest.raises(ValueError, match="--hyper_params: vanilla: .*max_num_seqs"):
        Runner(RunConfig(hyper_params={"max_num_seqs": 0}, out_dir=str(tmp_path)), tokenizer=object())


def test_tasks_reported_under_one_name_are_rejected(tmp_path):
    for name in ("a/qa.jsonl", "b/qa.jsonl", "fidelity.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    for tasks in ([f"{tmp_path}/a/qa.jsonl:f1", f"{tmp_path}/a/qa.jsonl:rouge_l"],
                  [f"{tmp_path}/a/qa.jsonl", f"{tmp_path}/b/qa.jsonl"],
                  [f"{tmp_path}/fidelity.jsonl"], ["fidelity", "fidelity"]):
        with pytest.raises(ValueError, match="--tasks: .*reported as task"):
            Runner(RunConfig(tasks=tasks, out_dir=str(tmp_path)), llm_factory=lambda *a: None,
                   tokenizer=object())


def test_cli_parses_lengths_lists_and_json():
    config = parse_args(["--methods", "quest", "--lengths", "1k,2K,3000", "--samples", "3",
                         "--hyper_params", '{"quest": {"quest_token_budget": [256, 512]}}',
                         "--no_chat_template", "--tasks", "niah_multikey,fidelity"])
    assert config.lengths == [1024, 2048, 3000] and config.samples == 3
    assert config.methods == ["quest"] and not config.chat_template
    assert config.hyper_params == {"quest": {"quest_token_budget": [256, 512]}}
    assert config.tasks == ["niah_multikey", "fidelity"]
    with pytest.raises(SystemExit):
        parse_args(["--lengths", "abc"])


def test_cli_defaults_are_run_config_defaults_and_shown_in_help(capsys):
    assert parse_args([]) == RunConfig()
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())   # undo argparse's line wrapping
    for shown in ("--methods METHODS comma-separated methods; vanilla is always run as the reference "
                  "(default: vanilla)", "(default: 1k,2k,4k)", "(default: 20)", "(default: {})",
                  "(default: regression_out)", "(default: 5.0)", "(default: 32)"):
        assert shown in text, shown
    # every option of the usage line ([--model MODEL] ..., all but [-h]) states its default
    assert text.count("(default: ") == text.count("[--") == 13


def test_cli_names_the_json_error_of_hyper_params(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--hyper_params", "{bad"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert ("argument --hyper_params: not valid JSON (Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)): '{bad'") in err
    assert "invalid loads value" not in err


def test_cli_unknown_knob_is_one_error_line_with_the_suggestion(tmp_path, capsys):
    out_dir = tmp_path / "out"
    rc = main(["--methods", "quest", "--hyper_params", '{"quest": {"quest_token_budgt": 256}}',
               "--out_dir", str(out_dir)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == ("error: --hyper_params: quest: unknown knob 'quest_token_budgt'; "
                   "did you mean 'quest_token_budget'?\n")
    assert not out_dir.exists()   # rejected before anything ran


def test_smoke_run_through_the_engine_with_a_tiny_random_model(tmp_path):
    pytest.importorskip("sparsevllm.llm")
    model = build_tiny_llama(str(tmp_path / "tiny"))
    data = tmp_path / "toy.jsonl"
    data.write_text(json.dumps({"context": "The capital of France is Paris. " * 80,
                                "input": "What is the capital of France?", "answers": ["Paris"]}) + "\n")
    out = tmp_path / "out"
    # Few, short-answer tasks: a random model never stops, so each costs max_tokens decode steps.
    config = RunConfig(model=model, methods=["vanilla"], samples=2, lengths=[512, 768],
                       tasks=["niah_single_number_noise", "fidelity", f"{data}:contains"],
                       hyper_params={"max_model_len": 1024, "dtype": "float32"},
                       out_dir=str(out), fidelity_tokens=4)
    summary = Runner(config).run()
    for name in ARTIFACTS:
        assert (out / name).stat().st_size > 0, name
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 2 * 2 - 2  # the one-line dataset gives one sample per length
    assert all(r["error"] is None for r in records), [r["error"] for r in records if r["error"]]
    fidelity = [c for c in summary["cells"] if c["task"] == "fidelity"]
    assert all(c["accuracy"] == 100.0 and abs(c["kl"]) < 1e-6 for c in fidelity)


@pytest.mark.long   # the default model over 1K-token prompts
def test_smollm2_vanilla_retrieves_passkeys_at_1k(tmp_path):
    """Measured: vanilla SmolLM2-135M-Instruct finds every number needle in noise at 1K."""
    config = RunConfig(model=None, methods=["vanilla"], samples=4, lengths=[1024],
                       tasks=["niah_single_number_noise", "fidelity"], out_dir=str(tmp_path),
                       fidelity_tokens=16)
    summary = Runner(config).run()
    cells = {c["task"]: c for c in summary["cells"]}
    assert cells["niah_single_number_noise"]["accuracy"] == 100.0
    assert cells["fidelity"]["accuracy"] == 100.0
    assert cells["fidelity"]["text_top1"] > 40.0  # the model does predict the docs text
    assert summary["pass"]
