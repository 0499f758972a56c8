"""One report: the grid's accuracy cells (regression harness), its speed cells (benchmark), the
budget accounting of every cell, joined into rows and written as report.md, report.html and
report.json. Each half keeps its own resumable store under out_dir, so a rerun computes only what
is missing and rewrites the page."""

import dataclasses
import json
import logging
import os
import time

from sparsevllm.report.grid import BUDGET_KNOBS, Grid, cell_knobs, cells as grid_cells, grid_dict

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Options:
    grid: Grid
    out_dir: str = "report_out"
    model: str | None = None               # accuracy model (None: the embedded SmolLM2-135M)
    deltakv_compressor: str | None = None  # trained for the accuracy model
    recall_every: int = 4                  # answers are short: see __main__'s --recall_every
    skip_accuracy: bool = False
    skip_speed: bool = False
    time_limit: float | None = None        # seconds; work not done by then is 'not run' (a rerun does it)
    case_timeout: float = 1800.0
    command: str = ""


def embedded_model_missing() -> str | None:
    """Why the embedded model cannot be used here, or None."""
    from sparsevllm.default_model import find_gguf
    try:
        find_gguf()
    except Exception as e:
        return str(e)
    return None


def model_folder(model: str | None) -> str:
    from sparsevllm.default_model import resolve_model
    return model if model and os.path.isdir(model) else resolve_model(model)


def accounting_for(grid: Grid, cells, speed: dict, speed_model: str, preset: bool) -> dict:
    """Cell -> budget accounting on the speed model at the speed length (None where it fails)."""
    from sparsevllm.report.accounting import budget_accounting, dtype_bytes
    from sparsevllm.report.speed import model_config as load_model_config

    model_config = load_model_config(speed_model)
    rows = [(r.get("row") or {}) for r in speed.values()]
    dtype = next((r.get("dtype") for r in rows if r.get("dtype")), None)
    on_gpu = any((r.get("environment") or {}).get("gpu") for r in rows)
    if dtype is None:
        import torch
        on_gpu = torch.cuda.is_available()
    width = dtype_bytes(dtype, on_gpu)
    out = {}
    for cell in cells:
        knobs = dict((speed.get(cell) or {}).get("knobs") or cell_knobs(grid, cell))
        knobs.update(grid.speed_engine_knobs)
        if preset:
            knobs["load_format"] = "dummy"
        try:
            out[cell] = budget_accounting(cell.method, knobs, model_config, grid.speed_length, grid.output_len, width)
        except (ValueError, TypeError) as e:
            logger.warning("no budget accounting for %s: %s", cell.label, e)
    return out


def device(speed: dict) -> str:
    envs = [(r.get("row") or {}).get("environment") or {} for r in speed.values()]
    gpu = next((e["gpu"] for e in envs if e.get("gpu")), None)
    return gpu or ("CPU" if envs else "-")


def header(opts: Options, speed_model: str, preset: bool, recall: str, elapsed: float, where: str) -> list[str]:
    g = opts.grid
    return [
        f"grid **{g.name}**: methods {', '.join(g.methods)} x budgets {', '.join(map(str, g.budgets))} tokens",
        f"accuracy: the regression harness on **{opts.model or 'the embedded SmolLM2-135M-Instruct'}** (its "
        f"weights): tasks {', '.join(g.tasks)}, lengths {', '.join(map(str, g.lengths))}, {g.samples} samples each",
        f"speed: the benchmark on **{speed_model}** ({'random weights, the model preset' if preset else 'its weights'})"
        f", {g.speed_length} tokens x batch {g.speed_batch}, {g.output_len} tokens out, on {where}"
        + (f", engine knobs `{json.dumps(g.speed_engine_knobs)}`" if g.speed_engine_knobs else ""),
        f"attention recall: {recall}",
        f"made by `{opts.command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in {elapsed:.0f} s"
        f" (this run's computing; stored cells are reused)",
    ]


def make_report(opts: Options) -> dict:
    from sparsevllm.report.pareto import build_rows
    from sparsevllm.report.render import write_page

    start = time.monotonic()
    deadline = start + opts.time_limit if opts.time_limit else None
    g = opts.grid
    os.makedirs(opts.out_dir, exist_ok=True)
    cells = grid_cells(g)
    notes = []

    accuracy = {}
    from sparsevllm.report.accuracy import no_result, recall_supported, run_accuracy
    recall_on = bool(opts.recall_every) and recall_supported()
    if opts.recall_every and not recall_on:
        recall = "'-': this engine has no `recall_sample_every` knob yet (issue #52, part 1)"
    elif recall_on:
        recall = f"sampled on every {opts.recall_every}-th decode step of the accuracy runs"
    else:
        recall = "off (--recall_every 0)"
    needs_embedded = opts.model is None and (not opts.skip_accuracy or g.speed_model is None)
    missing = embedded_model_missing() if needs_embedded else None
    if opts.skip_accuracy:
        notes.append("accuracy was not run (--skip_accuracy)")
    elif missing:
        notes.append(f"accuracy skipped: the embedded model is not installed here ({missing})")
    else:
        try:
            accuracy, acc_notes = run_accuracy(g, cells, opts.out_dir, model=opts.model,
                                               recall_every=opts.recall_every if recall_on else 0,
                                               deltakv_compressor=opts.deltakv_compressor, deadline=deadline)
            notes += acc_notes
        except Exception as e:   # e.g. a length the task's prompt cannot fit: the speed half still runs
            logger.exception("the accuracy half failed")
            accuracy = {c: no_result("failed", f"{type(e).__name__}: {e}") for c in cells}

    from sparsevllm.report.speed import is_preset, run_speed
    speed, accounting = {}, {}
    speed_model = g.speed_model or (None if missing else model_folder(opts.model))
    preset = speed_model is not None and is_preset(speed_model)
    if speed_model is None:
        notes.append("speed skipped: its model is the accuracy model, which is not installed here")
    elif not opts.skip_speed:
        speed = run_speed(g, cells, speed_model, opts.out_dir, deltakv_compressor=opts.deltakv_compressor,
                          case_timeout=opts.case_timeout, deadline=deadline)
        if "deltakv" in g.methods and preset:
            notes.append("DeltaKV's speed runs with a random compressor of the model's shape (the preset has "
                         "random weights: its speed depends on the shape, not the values)")
        envs = [(r.get("row") or {}).get("environment") or {} for r in speed.values()]
        if envs and not any(e.get("gpu") for e in envs):
            notes.append("speed was measured on a CPU, where a decode step is mostly per-operator overhead "
                         "(eager PyTorch dispatches each from Python): speed-ups there say little about a GPU's")

    else:
        notes.append("speed was not run (--skip_speed)")
    if any(r.get("status") == "not run" for half in (accuracy, speed) for r in half.values()):
        notes.append(f"the time limit ({opts.time_limit:.0f} s) stopped this run: the cells marked 'not run' "
                     "run when this command is repeated with the same --out_dir")
    if speed_model is not None:
        accounting = accounting_for(g, cells, speed, speed_model, preset)

    rows = build_rows(cells, accuracy, speed, accounting)
    meta = {"title": "Sparse-vLLM report: accuracy x speed x memory",
            "header": header(opts, g.speed_model or opts.model or "the embedded SmolLM2-135M-Instruct", preset,
                             recall, time.monotonic() - start, device(speed)),
            "notes": notes, "budget_knobs": {m: BUDGET_KNOBS[m] for m in g.methods if m in BUDGET_KNOBS},
            "grid": grid_dict(g), "command": opts.command}
    paths = write_page(rows, meta, opts.out_dir)
    with open(os.path.join(opts.out_dir, "report.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    return {"rows": rows, "meta": meta, "paths": paths}
