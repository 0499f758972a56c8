"""The accuracy x speed x memory report (python -m sparsevllm.report): its Pareto fronts, the budget
accounting against the arithmetic of BENCHMARKS.md, the page rendered from fixture rows, a failed
cell marked while the others run, and a small end-to-end run on the tiny random Llama that a second
run answers from its stores without recomputing anything."""
import dataclasses
import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from regression_fixtures import build_tiny_llama  # noqa: E402

from sparsevllm.report import speed as speed_mod  # noqa: E402
from sparsevllm.report.accounting import budget_accounting  # noqa: E402
from sparsevllm.report.grid import QUICK, Cell, cells  # noqa: E402
from sparsevllm.report.pareto import build_rows, pareto_front  # noqa: E402
from sparsevllm.report.render import page, to_html, to_markdown  # noqa: E402

PRESETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "sparsevllm", "presets")


def preset(name):
    with open(os.path.join(PRESETS, name + ".json")) as f:
        return json.load(f)


# ---- Pareto fronts ------------------------------------------------------------------------------------
def test_pareto_front_keeps_the_points_no_other_point_beats():
    # (speed-up, accuracy): (2, 90) beats (1.5, 80); (3, 50) and (1, 100) are extremes; a tie is kept
    pts = [(1.0, 100.0), (2.0, 90.0), (1.5, 80.0), (3.0, 50.0), (3.0, 50.0), (2.5, 40.0)]
    assert pareto_front(pts) == {0, 1, 3, 4}


def test_pareto_front_on_memory_prefers_less():
    # (MiB, accuracy): less memory is better; (100, 90) beats (200, 90) and (150, 80)
    pts = [(400.0, 100.0), (100.0, 90.0), (200.0, 90.0), (150.0, 80.0), (50.0, 20.0)]
    assert pareto_front(pts, x_higher_is_better=False) == {0, 1, 4}


# ---- the command line -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, msg", [(["--methods", "quest,nope"], "nope"), (["--budgets", "0"], "positive"),
                                       (["--grid", "huge"], "invalid choice"), (["--samples", "0"], "--samples")])
def test_bad_arguments_are_refused_before_anything_runs(argv, msg, capsys):
    from sparsevllm.report.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


# ---- budget accounting -------------------------------------------------------------------------------
def test_accounting_of_vanilla_and_snapkv_on_the_llama_shape():
    """Llama-3.1-8B in bf16 holds 2 x 32 layers x 8 KV heads x 128 x 2 B = 128 KiB a token
    (BENCHMARKS.md); vanilla reads its whole cache, SnapKV its capacity, plus what decode appended
    (on average (output_len - 1) / 2 tokens over the steps)."""
    cfg, L, O = preset("llama-3.1-8b"), 32768, 128
    van = budget_accounting("vanilla", {"load_format": "dummy"}, cfg, L, O, 2)
    snap = budget_accounting("snapkv", {"load_format": "dummy", "snapkv_capacity": 1024}, cfg, L, O, 2)
    assert van["kv_bytes_per_token"] == 128 * 1024
    assert van["kv_tokens_read"] == pytest.approx(L + (O - 1) / 2)
    assert van["kv_bytes_held"] == (L + O) * 128 * 1024
    assert snap["kv_tokens_read"] == pytest.approx(1024 + (O - 1) / 2)
    assert snap["kv_tokens_held"] is None   # SnapKV cannot say its peak ahead: the page shows the measured one


def test_accounting_counts_the_dense_layers_a_budget_does_not_cover():
    """OmniKV's filter layers read everything whatever its budget: at the same 1024-token budget it
    reads more than QuEST, which reads its selection plus 1/P of the keys as page bounds, and both
    read far less than vanilla."""
    cfg, L, O = preset("llama-3.1-8b"), 32768, 16
    read = {m: budget_accounting(m, {"load_format": "dummy", **knobs}, cfg, L, O, 2)["kv_tokens_read"]
            for m, knobs in [("vanilla", {}), ("quest", {"quest_token_budget": 1024}),
                             ("omnikv", {"omnikv_num_selected": 1024})]}
    assert read["quest"] < read["omnikv"] < read["vanilla"]
    assert read["omnikv"] > 1024 + L * 3 / 32   # at least its 3 (scaled) dense filter layers of 32


# ---- rows and the page from fixture rows ------------------------------------------------------------------
VANILLA, QUEST, SNAP = Cell("vanilla", None), Cell("quest", 256), Cell("snapkv", 256)


def fixture_rows():
    def acc(a, recall=None):
        return {"status": "ok", "accuracy": a, "recall": recall, "per_task": {"niah@512": a}, "error": None}

    def spd(tok_s, used):
        return {"status": "ok", "error": None,
                "row": {"decode_tok_s": tok_s, "ttft_mean_s": 0.01, "batch": 2,
                        "memory_accounting_peak": {"kv_used_bytes": used}}}

    accuracy = {VANILLA: acc(100.0, 1.0), QUEST: acc(75.0, 0.8),
                SNAP: {"status": "failed", "accuracy": None, "recall": None, "per_task": {}, "error": "boom"}}
    speed = {VANILLA: spd(100.0, 8 << 20), QUEST: spd(200.0, 8 << 20)}
    speed[SNAP] = {"status": "oom", "error": "out of memory", "row": None}
    accounting = {c: {"kv_tokens_read": r, "kv_bytes_read": r * 10, "kv_tokens_held": h,
                      "kv_bytes_held": None if h is None else h * 10}
                  for c, r, h in [(VANILLA, 512, 512), (QUEST, 300, 512), (SNAP, 256, None)]}
    return build_rows([VANILLA, QUEST, SNAP], accuracy, speed, accounting)


def test_rows_carry_speed_up_delta_and_pareto_marks():
    van, quest, snap = fixture_rows()
    assert quest["speedup"] == 2.0 and quest["accuracy_delta"] == -25.0 and quest["read_share"] == 300 / 512
    assert quest["kv_memory_bytes"] == 4 << 20 and quest["kv_memory_source"] == "measured"
    assert van["pareto_speed"] and quest["pareto_speed"]
    # same measured memory, less accuracy: QuEST is not on the memory front
    assert van["pareto_memory"] and not quest["pareto_memory"]
    assert snap["pareto_speed"] is None and snap["speedup"] is None


def test_page_shows_recall_beside_accuracy_and_marks_failed_cells():
    rows = fixture_rows()
    meta = {"title": "t", "header": ["grid **x**"], "notes": ["a note"], "budget_knobs": {"quest": "quest_token_budget"}}
    md = to_markdown(page(rows, meta, "pareto.png", "<svg><circle/></svg>"))
    line = next(x for x in md.splitlines() if x.startswith("| quest | 256 |"))
    assert "| 75.0 | -25.0 | 0.800 | 200.0 | 2.00x |" in line
    snap = next(x for x in md.splitlines() if x.startswith("| snapkv | 256 |"))
    assert "accuracy **FAILED**: boom" in snap and "speed **OOM**: out of memory" in snap
    assert "## Failed, skipped or not run" in md and "![accuracy vs speed-up and vs KV memory](pareto.png)" in md
    doc = to_html(page(rows, meta, "pareto.png", "<svg><circle/></svg>"), "t")
    assert "<svg><circle/></svg>" in doc and "<b>FAILED</b>" in doc
    assert not re.search(r"<(img|script|link)\b", doc)   # self-contained: nothing fetched


# ---- the harness's side: the swept budgets and its summary read back per cell -----------------------------
def test_budgets_become_the_harness_sweep_and_its_summary_comes_back_per_cell():
    from sparsevllm.report.accuracy import cell_results, hyper_params
    grid = dataclasses.replace(QUICK, methods=["vanilla", "quest", "snapkv"], budgets=[64, 128])
    hp = hyper_params(grid, cells(grid), {"recall_sample_every": 16})
    assert hp == {"recall_sample_every": 16, "quest": {"quest_token_budget": [64, 128]},
                  "snapkv": {"snapkv_capacity": [64, 128]}}

    def cell(label, method, sweep, task, acc, recall=None, errors=0):
        return {"label": label, "method": method, "sweep": sweep, "task": task, "length": 512, "accuracy": acc,
                "errors": errors, "missing": 0, "attention_recall": recall}
    summary = {"cells": [cell("vanilla", "vanilla", {}, "a", 100.0, 1.0), cell("vanilla", "vanilla", {}, "b", 50.0, 1.0),
                         cell("quest[quest_token_budget=64]", "quest", {"quest_token_budget": 64}, "a", 80.0, 0.9),
                         cell("quest[quest_token_budget=64]", "quest", {"quest_token_budget": 64}, "b", 40.0, 0.7),
                         cell("snapkv[snapkv_capacity=64]", "snapkv", {"snapkv_capacity": 64}, "a", None, errors=4)]}
    out = cell_results(summary, ["snapkv[snapkv_capacity=64]: LLM(): RuntimeError('no')"])
    assert out[Cell("vanilla", None)]["accuracy"] == 75.0 and out[Cell("vanilla", None)]["recall"] == 1.0
    quest = out[Cell("quest", 64)]
    assert quest["accuracy"] == 60.0 and quest["recall"] == pytest.approx(0.8)
    assert quest["per_task"] == {"a@512": 80.0, "b@512": 40.0} and quest["status"] == "ok"
    snap = out[Cell("snapkv", 64)]
    assert snap["status"] == "failed" and "RuntimeError('no')" in snap["error"]


def test_the_harness_averages_each_requests_attention_recall_into_its_cell():
    from types import SimpleNamespace

    from sparsevllm.regression import report as regression_report
    from sparsevllm.regression.runner import RunConfig
    from sparsevllm.regression.variants import Variant
    v = Variant("quest", "quest", {}, {}, "quest")
    samples = [SimpleNamespace(task="niah", length=512, index=i, metric="contains", prompt_token_ids=[1, 2])
               for i in range(2)]
    samples.append(SimpleNamespace(task="niah", length=512, index=2, metric="contains", prompt_token_ids=[1]))
    # the third request decoded too few steps to be sampled: it has no mean and is left out
    records = {i: {"score": 1.0, "error": None, "latency_s": 0.1, "attention_recall": {"mean": m}}
               for i, m in enumerate([0.5, 0.7, None])}
    summary = regression_report.summarize(RunConfig(), [v], samples, records, lambda v, s: s.index, False)
    assert summary["cells"][0]["attention_recall"] == pytest.approx(0.6)


# ---- a failed speed cell, and the speed store's resumability -----------------------------------------------
def test_a_failed_speed_cell_is_recorded_and_rerun_while_finished_cells_are_not(tmp_path, monkeypatch):
    grid = dataclasses.replace(QUICK, methods=["vanilla", "quest"], budgets=[64, 128])
    calls = []

    def fake_run_cell(bench, grid, cell, model, knobs, out_dir, timeout):
        calls.append(cell)
        if cell.budget == 128:
            raise ValueError("quest_token_budget=128 is bad here")
        return {"status": "ok", "error": None, "decode_tok_s": 1.0, "batch": 2}

    monkeypatch.setattr(speed_mod, "run_cell", fake_run_cell)
    monkeypatch.setattr(speed_mod, "bench_module", lambda: None)
    first = speed_mod.run_speed(grid, cells(grid), "m", str(tmp_path))
    assert [first[c]["status"] for c in cells(grid)] == ["ok", "ok", "failed"]
    assert "quest_token_budget=128 is bad here" in first[Cell("quest", 128)]["error"]
    calls.clear()
    again = speed_mod.run_speed(grid, cells(grid), "m", str(tmp_path))
    assert calls == [Cell("quest", 128)]   # only the failed cell runs again
    assert again[Cell("quest", 64)]["row"]["decode_tok_s"] == 1.0


def test_cells_past_the_time_limit_are_not_run_and_not_stored(tmp_path, monkeypatch):
    grid = dataclasses.replace(QUICK, methods=["vanilla", "quest"], budgets=[64])
    monkeypatch.setattr(speed_mod, "run_cell", lambda *a: {"status": "ok", "error": None, "batch": 1})
    monkeypatch.setattr(speed_mod, "bench_module", lambda: None)
    ticks = iter([0.0, 10.0])
    out = speed_mod.run_speed(grid, cells(grid), "m", str(tmp_path), deadline=5.0, clock=lambda: next(ticks))
    assert [out[c]["status"] for c in cells(grid)] == ["ok", "not run"]
    assert len(speed_mod.SpeedStore(str(tmp_path)).load()) == 1


# ---- end to end on the tiny random Llama --------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(str(tmp_path_factory.mktemp("report") / "tiny"))


def test_the_accuracy_half_stops_at_the_time_limit(tiny, tmp_path):
    import time

    from sparsevllm.report.accuracy import run_accuracy
    grid = dataclasses.replace(QUICK, methods=["vanilla"], lengths=[320], samples=1)
    out, _ = run_accuracy(grid, cells(grid), str(tmp_path), model=tiny, deadline=time.monotonic())
    assert out[Cell("vanilla", None)]["status"] == "not run"


def test_report_end_to_end_resumes_without_recomputing(tiny, tmp_path, monkeypatch):
    """vanilla and SnapKV at capacities 8 (invalid: a capacity must exceed SnapKV's 32-token window,
    so the cell fails in both halves) and 64, one sample of 320 tokens, speed at 320 x 2. The second
    run adds no sample to the harness's store, starts no benchmark case, and writes the same rows."""
    from sparsevllm.report.build import Options, make_report

    grid = dataclasses.replace(QUICK, methods=["vanilla", "snapkv"], budgets=[8, 64], lengths=[320], samples=1,
                               speed_model=tiny, speed_length=320, speed_batch=2, output_len=8)
    opts = Options(grid=grid, out_dir=str(tmp_path), model=tiny, command="test")
    first = make_report(opts)
    by = {r["label"]: r for r in first["rows"]}
    assert set(by) == {"vanilla", "snapkv @ 8", "snapkv @ 64"}
    assert by["vanilla"]["accuracy_status"] == "ok" and by["vanilla"]["speed_status"] == "ok"
    assert by["snapkv @ 64"]["speedup"] is not None and by["snapkv @ 64"]["accuracy"] is not None
    bad = by["snapkv @ 8"]
    assert bad["accuracy_status"] == "failed" and "snapkv_capacity" in bad["accuracy_error"]
    assert bad["speed_status"] == "failed" and "snapkv_capacity" in bad["speed_error"]
    md = open(first["paths"]["markdown"]).read()
    assert "snapkv @ 8: accuracy **FAILED**" in md
    assert os.path.isfile(first["paths"]["html"])

    def never(*a, **k):
        raise AssertionError("a finished speed cell was recomputed")

    samples = open(tmp_path / "accuracy" / "samples.jsonl").read()
    bench = speed_mod.bench_module()
    monkeypatch.setattr(bench, "run_sweep", never)   # the failed cell runs again, and fails in validate
    second = make_report(opts)
    assert open(tmp_path / "accuracy" / "samples.jsonl").read() == samples   # the harness ran no sample
    keys = ("accuracy", "decode_tok_s", "kv_tokens_read", "accuracy_status", "speed_status")
    assert [[r[k] for k in keys] for r in second["rows"]] == [[r[k] for k in keys] for r in first["rows"]]


@pytest.mark.long
def test_every_method_of_the_full_grid_runs_its_speed_cells_on_the_tiny_preset(tmp_path):
    """The full grid's six methods (DeltaKV with the random compressor a preset gets, HiSparse through
    its host pool) at two budgets on the `tiny` preset, accuracy skipped: every cell but SnapKV at 32
    (not above its 32-token window) runs, and each has its budget accounting."""
    from sparsevllm.report.build import Options, make_report
    from sparsevllm.report.grid import FULL

    grid = dataclasses.replace(FULL, budgets=[32, 64], speed_model="tiny", speed_length=256, speed_batch=2,
                               output_len=8, speed_engine_knobs={},
                               method_knobs={"hisparse": {"hisparse_min_prompt_len": 128,
                                                          "hisparse_host_memory_gb": 0.1}})
    rows = make_report(Options(grid=grid, out_dir=str(tmp_path), skip_accuracy=True, command="test"))["rows"]
    assert len(rows) == 11
    failed = [r["label"] for r in rows if r["speed_status"] != "ok"]
    assert failed == ["snapkv @ 32"]
    assert all(r["kv_tokens_read"] is not None for r in rows if r["label"] != "snapkv @ 32")
    hisparse = next(r for r in rows if r["label"] == "hisparse @ 32")
    assert hisparse["kv_tokens_read"] < rows[0]["kv_tokens_read"]   # a 2-page view, not the whole cache
