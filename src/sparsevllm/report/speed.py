"""Speed cells through the throughput benchmark (scripts/benchmarks/bench_sparse_vllm.py): each
cell is one benchmark case in its own process (a crash or out-of-memory is that cell's status),
measured the benchmark's way (decode over the stable window, TTFT, KV memory accounting).

Results are kept in <out_dir>/speed.jsonl, one line per finished cell keyed by everything that
defines it; a rerun skips every cell stored as ok, and runs the failed ones again."""

import importlib.util
import json
import logging
import os
import shlex
import sys
import time

from sparsevllm.regression.records import append_records, read_records
from sparsevllm.report.grid import Cell, Grid, cell_knobs, spec_id

logger = logging.getLogger(__name__)

BENCH_SCRIPT = os.path.join("scripts", "benchmarks", "bench_sparse_vllm.py")


def bench_module():
    """The benchmark script of this checkout, imported by path: it lives beside its helpers in
    scripts/benchmarks (bench_case, bench_roofline, bench_report), not in the installed package."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    path = os.path.join(root, BENCH_SCRIPT)
    if "bench_sparse_vllm" in sys.modules:
        return sys.modules["bench_sparse_vllm"]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the speed half needs {BENCH_SCRIPT} of a source checkout; not found at {path}")
    spec = importlib.util.spec_from_file_location("bench_sparse_vllm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_sparse_vllm"] = module
    spec.loader.exec_module(module)
    return module


PRESETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "presets")


def is_preset(model: str) -> bool:
    """A benchmark preset name (run with random weights), not a model folder."""
    return not os.path.isdir(model) and os.path.isfile(os.path.join(PRESETS, model + ".json"))


def model_config(model: str) -> dict:
    """config.json of a model folder or a preset (what the benchmark loads)."""
    path = os.path.join(model, "config.json") if os.path.isdir(model) else os.path.join(PRESETS, model + ".json")
    with open(path) as f:
        return json.load(f)


class SpeedStore:
    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, "speed.jsonl")

    def load(self) -> dict[str, dict]:
        return read_records(self.path, "id")

    def append(self, record: dict) -> None:
        append_records(self.path, [record])


def cell_spec(grid: Grid, cell: Cell, model: str, knobs: dict) -> dict:
    return {"kind": "speed", "model": model, "method": cell.method, "knobs": knobs,
            "engine_knobs": grid.speed_engine_knobs, "length": grid.speed_length,
            "batch": grid.speed_batch, "output_len": grid.output_len}


def run_cell(bench, grid: Grid, cell: Cell, model: str, knobs: dict, out_dir: str, case_timeout: float) -> dict:
    """One benchmark case; returns its results.jsonl row (status ok, failed or oom)."""
    argv = ["--model_path", model, "--methods", cell.method, "--lengths", str(grid.speed_length),
            "--batch_sizes", str(grid.speed_batch), "--output_len", str(grid.output_len),
            "--hyper_params", json.dumps({**grid.speed_engine_knobs, **knobs}), "--out_dir", out_dir,
            "--case_timeout", str(case_timeout)]
    args = bench.build_parser().parse_args(argv)
    args.command = shlex.join(["python", BENCH_SCRIPT, *argv])
    plan = bench.validate(args)   # a ValueError names the bad knob; the caller marks the cell
    return bench.run_sweep(args, plan)[0]


def run_speed(grid: Grid, cells: list[Cell], model: str, out_dir: str, *, deltakv_compressor: str | None = None,
              case_timeout: float = 1800.0, deadline: float | None = None, clock=None) -> dict[Cell, dict]:
    """Cell -> its record ({"status", "error", "row", "knobs"}); cells past the deadline are
    recorded as not run (nothing stored, so a rerun runs them)."""
    from tqdm.auto import tqdm

    clock = clock or time.monotonic
    store = SpeedStore(out_dir)
    done = store.load()
    results, bench = {}, None
    bar = tqdm(cells, desc="speed", unit="cell")
    for cell in bar:
        bar.set_postfix_str(cell.label)
        knobs = cell_knobs(grid, cell)
        # On a preset (random weights) DeltaKV builds a random compressor of the model's shape: speed
        # depends on its shape, not its values. A real model needs a trained one.
        if cell.method == "deltakv" and deltakv_compressor and not is_preset(model):
            knobs.setdefault("deltakv_compressor_path", deltakv_compressor)
        spec = cell_spec(grid, cell, model, knobs)
        cid = spec_id(spec)
        old = done.get(cid)
        if old is not None and old["status"] == "ok":
            results[cell] = old
            continue
        if deadline is not None and clock() >= deadline:
            results[cell] = {"id": cid, "status": "not run", "error": "time limit reached", "row": None,
                             "knobs": knobs}
            continue
        record = {"id": cid, "method": cell.method, "budget": cell.budget, "spec": spec, "knobs": knobs}
        try:
            bench = bench or bench_module()
            row = run_cell(bench, grid, cell, model, knobs, os.path.join(out_dir, "speed", f"{cell.method}-{cid}"),
                           case_timeout)
            record.update(status=row["status"], error=row.get("error"), row=row)
        except ValueError as e:  # a knob the benchmark refuses (a SnapKV capacity below its window)
            logger.warning("speed cell %s: %s", cell.label, e)
            record.update(status="failed", error=f"ValueError: {e}", row=None)
        except Exception as e:  # one broken cell must not end the grid
            logger.exception("speed cell %s failed", cell.label)
            record.update(status="failed", error=f"{type(e).__name__}: {e}", row=None)
        store.append(record)
        results[cell] = record
    return results
