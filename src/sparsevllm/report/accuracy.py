"""Accuracy cells through the regression harness: one RunConfig whose hyper_params sweep each
method's budget knob, run by its Runner into <out_dir>/accuracy (its samples.jsonl is the store:
a rerun skips every finished sample), then its summary read back per (method, budget).

The harness runs in a process of its own: a method that crashes the interpreter fails the accuracy
half only, and the GPU memory its engines held is back before the speed cases size their pools."""

import dataclasses
import json
import logging
import multiprocessing
import os
import time

from sparsevllm.report.grid import BUDGET_KNOBS, Cell, Grid, cell_knobs

logger = logging.getLogger(__name__)

RECALL_KNOB = "recall_sample_every"


def recall_supported() -> bool:
    """Whether the engine has attention-recall telemetry (issue #52, part 1): an older engine
    rejects the knob as unknown, so it is asked for only where it exists."""
    from sparsevllm.config import ENGINE_KNOBS
    return RECALL_KNOB in ENGINE_KNOBS


def check_cell(model, cell: Cell, knobs: dict) -> str | None:
    """Why LLM() would refuse this cell's knobs, or None: one bad budget (a SnapKV capacity below
    its window) must fail its own cell, not the harness's up-front check of every variant."""
    from sparsevllm.method_registry import make_config
    try:
        make_config(model, cell.method, **knobs)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def hyper_params(grid: Grid, cells: list[Cell], engine_knobs: dict) -> dict:
    """The harness's --hyper_params for these cells: each method's fixed knobs and its budgets as a
    swept list (vanilla: its fixed knobs only); engine knobs go to every variant."""
    hp = dict(engine_knobs)
    for cell in cells:
        knobs = cell_knobs(grid, cell)
        mine = hp.setdefault(cell.method, {})
        for k, v in knobs.items():
            if cell.budget is not None and k == BUDGET_KNOBS[cell.method]:
                mine.setdefault(k, []).append(v)
            else:
                mine[k] = v
    return {k: v for k, v in hp.items() if v != {}}


def cell_of(summary_cell: dict) -> Cell:
    method = summary_cell["method"]
    return Cell(method, None if method == "vanilla" else summary_cell["sweep"].get(BUDGET_KNOBS[method]))


def cell_results(summary: dict, errors: list[str]) -> dict[Cell, dict]:
    """The harness's summary -> per cell: accuracy per (task, length), their mean, the mean
    attention recall, and the first error of a failed cell."""
    out = {}
    for c in summary["cells"]:
        cell = cell_of(c)
        r = out.setdefault(cell, {"label": c["label"], "per_task": {}, "errors": 0, "missing": 0,
                                  "recall": [], "error": None})
        r["per_task"][f"{c['task']}@{c['length']}"] = c["accuracy"]
        r["errors"] += c["errors"]
        r["missing"] += c["missing"]
        if c.get("attention_recall") is not None:
            r["recall"].append(c["attention_recall"])
    for cell, r in out.items():
        accs = list(r["per_task"].values())
        r["accuracy"] = None if not accs or None in accs else sum(accs) / len(accs)
        r["recall"] = sum(r["recall"]) / len(r["recall"]) if r["recall"] else None
        if r["errors"] or r["accuracy"] is None:
            first = next((e for e in errors if e.startswith(r["label"] + " ") or e.startswith(r["label"] + ":")),
                         None)
            r["status"] = "failed"
            r["error"] = first or f"{r['errors']} samples failed, {r['missing']} missing"
        else:
            r["status"] = "ok"
    return out


def run_harness(config: dict) -> None:
    """The child process: the harness's Runner over one RunConfig (as a dict: it crosses a spawn)."""
    from sparsevllm.regression.runner import RunConfig, Runner
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    Runner(RunConfig(**config)).run()


def no_result(status: str, error: str) -> dict:
    """A cell's accuracy result when the harness gave none: skipped, failed or not run."""
    return {"status": status, "accuracy": None, "recall": None, "per_task": {}, "error": error}


def run_accuracy(grid: Grid, cells: list[Cell], out_dir: str, *, model=None, recall_every: int = 0,
                 deltakv_compressor: str | None = None,
                 deadline: float | None = None) -> tuple[dict[Cell, dict], list[str]]:
    """Cell -> result, and the notes the page states (skipped cells and why). At the deadline
    (time.monotonic()) the harness is stopped and its cells are 'not run'."""
    from sparsevllm.regression.runner import RunConfig

    notes, results, runnable = [], {}, []
    for cell in cells:
        knobs = cell_knobs(grid, cell)
        if cell.method == "deltakv":
            if not deltakv_compressor:
                results[cell] = no_result("skipped", "needs a trained compressor (--deltakv_compressor DIR)")
                continue
            knobs["deltakv_compressor_path"] = deltakv_compressor
        why = check_cell(model, cell, knobs)
        if why:
            results[cell] = no_result("failed", why)
            continue
        runnable.append(cell)
    if any(r["status"] == "skipped" for r in results.values()):
        notes.append("DeltaKV's accuracy needs a compressor trained for the accuracy model "
                     "(`python -m sparsevllm.tools.train_deltakv --out DIR`, then `--deltakv_compressor DIR`); "
                     "without one its accuracy cells are skipped and only its speed is measured.")
    hp = hyper_params(grid, runnable, {RECALL_KNOB: recall_every} if recall_every else {})
    if deltakv_compressor and any(c.method == "deltakv" for c in runnable):
        hp["deltakv"]["deltakv_compressor_path"] = deltakv_compressor
    config = RunConfig(model=model, methods=sorted({c.method for c in runnable}), tasks=list(grid.tasks),
                       lengths=list(grid.lengths), samples=grid.samples, hyper_params=hp,
                       out_dir=os.path.join(out_dir, "accuracy"))
    child = multiprocessing.get_context("spawn").Process(target=run_harness, args=(dataclasses.asdict(config),))
    child.start()
    child.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    if child.is_alive():   # the time limit: samples finished so far are on disk, a rerun resumes
        child.terminate()
        child.join()
        for cell in runnable:
            results[cell] = no_result("not run", "time limit reached (finished samples are kept; a rerun resumes)")
        return results, notes
    if child.exitcode != 0:
        raise RuntimeError(f"the regression harness exited with code {child.exitcode} (its log is above; "
                           "finished samples are kept and a rerun resumes)")
    with open(os.path.join(config.out_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(config.out_dir, "run.json")) as f:
        errors = json.load(f).get("errors", [])
    results.update(cell_results(summary, errors))
    return results, notes
