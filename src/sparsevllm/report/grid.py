"""The grid a report runs: methods x token budgets, the accuracy tasks and lengths, the speed case.

A budget is one number for every method, the tokens one decode step may attend to (snapkv: the
prompt tokens it keeps), set through each method's own knob (BUDGET_KNOBS). What each setting
really reads and holds is then accounted the same way for all of them (accounting.py), so a reader
compares like with like even where a method adds dense layers or metadata to its budget.
"""

import hashlib
import json
from dataclasses import asdict, dataclass, field

# method -> the knob its budget sets; vanilla has none (it is the reference point)
BUDGET_KNOBS = {
    "quest": "quest_token_budget",
    "snapkv": "snapkv_capacity",
    "omnikv": "omnikv_num_selected",
    "deltakv": "deltakv_decode_keep",
    "hisparse": "hisparse_token_budget",
}
ALL_METHODS = ["vanilla", "snapkv", "omnikv", "quest", "deltakv", "hisparse"]


@dataclass
class Grid:
    name: str
    methods: list[str]
    budgets: list[int]
    # accuracy: the regression harness on the accuracy model (None: the embedded SmolLM2-135M)
    tasks: list[str]
    lengths: list[int]
    samples: int
    # speed: the benchmark on the speed model (a preset run with random weights, or a folder; None:
    # the accuracy model), one (length, batch) case per cell
    speed_model: str | None
    speed_length: int
    speed_batch: int
    output_len: int
    # knobs every cell of a method gets besides its budget (short prompts need smaller windows)
    method_knobs: dict = field(default_factory=dict)
    # engine knobs of the speed cases (prefill chunking at long lengths)
    speed_engine_knobs: dict = field(default_factory=dict)


# On a 2-core CPU with SmolLM2-135M: 512-token prompts, 4 samples, budgets an eighth and a quarter
# of the prompt, so every method's sparse path runs while the grid finishes in minutes.
QUICK = Grid(
    name="quick", methods=["vanilla", "quest", "snapkv", "omnikv"], budgets=[64, 128],
    tasks=["niah_single_number_noise"], lengths=[512], samples=4,
    speed_model=None, speed_length=512, speed_batch=2, output_len=32,
    # for --methods ...,hisparse: its default keeps prompts under 2048 tokens dense and pins 8 GB
    method_knobs={"hisparse": {"hisparse_min_prompt_len": 256, "hisparse_host_memory_gb": 0.25}},
)

# On one H100/H200: accuracy on SmolLM2-135M (the budgets of the regression README's tables),
# speed on the Llama-3.1-8B shape with random weights at 32K x 4, as the README's results. The
# host pool of HiSparse holds every page of the batch: 4 x 32K x 128 KiB = 16 GiB (20 with room);
# its default keeps prompts under 2048 tokens dense, which would make the 2K accuracy cells vanilla's.
FULL = Grid(
    name="full", methods=list(ALL_METHODS), budgets=[256, 512, 1024],
    tasks=["niah_single_number_noise", "niah_multikey"], lengths=[2048, 4096], samples=10,
    speed_model="llama-3.1-8b", speed_length=32768, speed_batch=4, output_len=128,
    method_knobs={"hisparse": {"hisparse_min_prompt_len": 1024, "hisparse_host_memory_gb": 20.0}},
    speed_engine_knobs={"chunk_prefill_size": 8192, "max_num_batched_tokens": 16384},
)

GRIDS = {"quick": QUICK, "full": FULL}


@dataclass(frozen=True)
class Cell:
    method: str
    budget: int | None   # None: vanilla

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method} @ {self.budget}"


def cells(grid: Grid) -> list[Cell]:
    """Vanilla first, then budget-major: a run cut short by its time limit has every method at the
    first budgets rather than one method at every budget."""
    out = [Cell("vanilla", None)]   # always: the reference of every speed-up and accuracy drop
    for b in grid.budgets:
        out += [Cell(m, b) for m in grid.methods if m != "vanilla"]
    return out


def cell_knobs(grid: Grid, cell: Cell) -> dict:
    """The method knobs of one cell: the grid's fixed ones and the budget through the method's knob."""
    knobs = dict(grid.method_knobs.get(cell.method, {}))
    if cell.budget is not None:
        knobs[BUDGET_KNOBS[cell.method]] = cell.budget
    return knobs


def spec_id(spec: dict) -> str:
    """A short stable id of everything that defines a stored result: a changed grid never reuses it."""
    blob = json.dumps(spec, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:10]


def grid_dict(grid: Grid) -> dict:
    return asdict(grid)


def check_methods(methods: list[str]) -> None:
    unknown = [m for m in methods if m != "vanilla" and m not in BUDGET_KNOBS]
    if unknown:
        raise ValueError(f"--methods: {unknown} have no budget knob here; valid: {', '.join(ALL_METHODS)}")
