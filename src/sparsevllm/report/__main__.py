"""Command line: python -m sparsevllm.report [--grid quick|full] [--out_dir DIR] ...

Imports nothing heavy before the arguments are read: --help answers without torch."""

import argparse
import dataclasses
import logging
import shlex
import sys

from sparsevllm.report.grid import GRIDS, check_methods


def int_list(text: str) -> list[int]:
    try:
        out = [int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r} (use e.g. 256,512 or 2k)") from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"every value must be a positive integer, got {text!r}")
    return out


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sparsevllm.report",
        description="Accuracy (regression harness) x decode speed and KV memory (benchmark) over a grid of "
                    "methods x token budgets, written as one Markdown and one HTML page with Pareto plots. "
                    "Rerunning with the same --out_dir resumes: finished cells are not recomputed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--grid", choices=sorted(GRIDS), default="quick",
                   help="quick: vanilla, quest, snapkv, omnikv x 2 budgets on the embedded model (a few minutes on "
                        "a CPU); full: all six methods x 3 budgets, speed on the Llama-3.1-8B shape (a GPU)")
    p.add_argument("--out_dir", default="report_out", help="output folder (report.md, report.html, the stores)")
    p.add_argument("--methods", type=str_list, default=None, help="override the grid's methods (comma-separated)")
    p.add_argument("--budgets", type=int_list, default=None, help="override the grid's token budgets")
    p.add_argument("--tasks", type=str_list, default=None, help="override the grid's regression tasks")
    p.add_argument("--lengths", type=int_list, default=None, help="override the grid's accuracy prompt lengths")
    p.add_argument("--samples", type=int, default=None, help="override the grid's samples per task and length")
    p.add_argument("--speed_model", default=None,
                   help="override the grid's speed model: a benchmark preset (random weights) or a model folder")
    p.add_argument("--speed_length", type=int, default=None, help="override the speed case's prompt length")
    p.add_argument("--speed_batch", type=int, default=None, help="override the speed case's batch")
    p.add_argument("--output_len", type=int, default=None, help="override the speed case's output tokens")
    p.add_argument("--model", default=None, help="accuracy model folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--deltakv_compressor", default=None,
                   help="a DeltaKV compressor trained for the accuracy model; without it DeltaKV's accuracy "
                        "cells are skipped")
    # Answers are 12-40 tokens: sampling every 16th step would measure a request once or not at all.
    p.add_argument("--recall_every", type=int, default=4,
                   help="attention recall sampled every N-th decode step of the accuracy runs (0: off; shown "
                        "as '-' where the engine lacks it)")
    p.add_argument("--skip_accuracy", action="store_true", help="run only the speed half")
    p.add_argument("--skip_speed", action="store_true", help="run only the accuracy half")
    p.add_argument("--time_limit", type=float, default=None,
                   help="seconds: the accuracy half is stopped and no speed cell starts after this; what is "
                        "left is marked 'not run' on the page (a rerun with the same --out_dir does it)")
    p.add_argument("--case_timeout", type=float, default=1800.0, help="seconds before a speed case is killed")
    return p


OVERRIDES = ("methods", "budgets", "tasks", "lengths", "samples", "speed_model", "speed_length", "speed_batch",
             "output_len")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    a = parser.parse_args(argv)
    grid = dataclasses.replace(GRIDS[a.grid], **{k: getattr(a, k) for k in OVERRIDES if getattr(a, k) is not None})
    if "vanilla" not in grid.methods:
        grid.methods = ["vanilla", *grid.methods]
    try:
        check_methods(grid.methods)
        if grid.samples <= 0 or a.recall_every < 0:
            raise ValueError("--samples must be positive and --recall_every >= 0")
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from sparsevllm.report.build import Options, make_report
    opts = Options(grid=grid, out_dir=a.out_dir, model=a.model, deltakv_compressor=a.deltakv_compressor,
                   recall_every=a.recall_every, skip_accuracy=a.skip_accuracy, skip_speed=a.skip_speed,
                   time_limit=a.time_limit, case_timeout=a.case_timeout,
                   command=shlex.join(["python", "-m", "sparsevllm.report", *argv]))
    result = make_report(opts)
    with open(result["paths"]["markdown"]) as f:
        print(f.read().split("## Definitions")[0].rstrip())   # the page, its glossary aside
    print(f"\nwrote {result['paths']['markdown']} and {result['paths']['html']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
