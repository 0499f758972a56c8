"""Engine knobs and the base of method knobs.

Every knob is a flat keyword argument of LLM(...). Engine knobs live in EngineConfig; each method
knob belongs to exactly one method's config dataclass (a MethodConfig subclass), prefixed with the
method name (quest_token_budget). `method_registry.make_config` splits and validates them without
loading a model, so the benchmark and the harness can reject bad input before any weights move.
This module imports nothing of the package: the cache managers and the registry build on it.
"""
import json
from dataclasses import dataclass, field, fields

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
# KV cache storage: "auto" stores the model dtype; "fp8" (= "fp8_e4m3") stores float8_e4m3fn.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# Under memory pressure ("auto"), a compaction scores a request's tokens from its last this-many
# tokens (SnapKV's default observation window, w = 32) and always keeps them.
PRESSURE_WINDOW = 32


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)   # True is an int to Python, not to a user


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def need(ok: bool, knob: str, value, valid: str) -> None:
    """The one error of a bad knob: its name, the value given and what is valid."""
    if not ok:
        raise ValueError(f"{knob}={value!r} is invalid; valid: {valid}")


def json_knobs(text: str, flag: str | None = None) -> dict:
    """A command line's JSON object of knob: value (the server's, the benchmark's and the harness's
    --hyper_params); a ValueError naming the flag, when given, if it is not JSON or not an object."""
    where = f"{flag} is " if flag else ""
    try:
        knobs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}not valid JSON ({e}): {text!r}") from None
    if not isinstance(knobs, dict):
        raise ValueError(f"{where}not a JSON object of knob: value: {text!r}")
    return knobs


class Knobs:
    """Validation shared by the engine's and the methods' knob dataclasses."""

    def need(self, ok: bool, knob: str, valid: str) -> None:
        need(ok, knob, getattr(self, knob), valid)


@dataclass
class MethodConfig(Knobs):
    """Base of a method's knob dataclass. Subclasses add fields named `<method>_<knob>`."""

    @classmethod
    def knob_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def validate(self, engine: "EngineConfig") -> None:
        """Raise ValueError naming the knob and its valid range. May read (and, for knobs the method
        dictates such as its page size, set) the engine's knobs: budgets that contradict each other
        are caught here, before any model loads."""


@dataclass
class EngineConfig(Knobs):
    model: str | None = None
    vllm_sparse_method: str = "vanilla"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"           # auto (the model dtype) | fp8 | fp8_e4m3 (the same)
    device: str = "auto"
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    chunk_prefill_size: int = 4096
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 2.0
    num_kv_pages: int | None = None
    enforce_eager: bool = False
    load_format: str = "auto"
    enable_prefix_caching: bool = True
    async_scheduling: bool | None = None   # None: on for CUDA, off on a CPU
    seed: int = 0
    tensor_parallel_size: int = 1
    # Measure attention recall on every N-th decode step of each request (docs/design.md, section
    # 10); 0: off, and then nothing on the step path changes.
    recall_sample_every: int = 0
    # vllm_sparse_method="auto" only: a request whose prompt is shorter than auto_dense_below tokens
    # decodes densely, a longer one with auto_method (its knobs: the method's, given at launch).
    auto_dense_below: int = 8192
    auto_method: str = "quest"
    # vllm_sparse_method="auto" only: when a decode step finds no page for a running request, free
    # pages by compacting the longest running request's KV to auto_compact_capacity tokens per KV
    # head (SnapKV-style, engine/cache_manager/pressure.py) instead of preempting and recomputing one.
    auto_compact_on_pressure: bool = True
    auto_compact_capacity: int = 2048
    # More methods a request may choose (SparseParams.method) besides vllm_sparse_method's and
    # "vanilla": each gets a cache manager of its own over the engine's one pool, and requests of
    # every hosted method decode in the same batch (docs/design.md, section 11). None: only those two.
    mixed_methods: list[str] | None = None
    method_config: MethodConfig = field(default_factory=MethodConfig, repr=False)
    # The cache-manager class the engine builds: vllm_sparse_method's (auto_method's for "auto"),
    # or, with mixed_methods, the composite over every hosted method. Looked up once, by make_config.
    method: type | None = field(default=None, repr=False)
    # Every sparse method a request of this engine may decode with -> (its class, its knobs as
    # launched): vllm_sparse_method's (auto_method's) and mixed_methods'. Set by make_config.
    hosted: dict = field(default_factory=dict, repr=False)

    @property
    def compacts_under_pressure(self) -> bool:
        """A decode step short of pages compacts a running request before it preempts one ("auto")."""
        return self.vllm_sparse_method == "auto" and self.auto_compact_on_pressure

    def validate(self) -> None:
        self.method_config.validate(self)  # first: a method may dictate an engine knob (its page size)
        need = self.need
        need(self.dtype in DTYPES, "dtype", " | ".join(DTYPES))
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", " | ".join(KV_CACHE_DTYPES))
        need(self.device in DEVICES, "device", " | ".join(DEVICES))
        need(self.load_format in LOAD_FORMATS, "load_format", " | ".join(LOAD_FORMATS))
        p = self.page_size
        need(isinstance(p, int) and p >= 1 and p & (p - 1) == 0, "page_size", "a power of two >= 1")
        for knob in ("max_num_seqs", "max_num_batched_tokens", "chunk_prefill_size"):
            need(isinstance(getattr(self, knob), int) and getattr(self, knob) >= 1, knob, "an integer >= 1")
        need(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 2),
             "max_model_len", "None (the model's context) or an integer >= 2")
        # (numbers are compared below: a string would raise a TypeError naming no knob)
        need(is_number(self.gpu_memory_utilization) and 0.0 < self.gpu_memory_utilization <= 1.0,
             "gpu_memory_utilization", "a fraction in (0, 1]")
        need(is_number(self.cpu_kv_cache_gb) and self.cpu_kv_cache_gb > 0, "cpu_kv_cache_gb", "a positive number of GiB")
        for knob in ("enforce_eager", "enable_prefix_caching"):   # "no" would read as True
            need(isinstance(getattr(self, knob), bool), knob, "True or False")
        need(is_int(self.seed) and -2**63 <= self.seed < 2**64,
             "seed", "an integer in [-2**63, 2**64) (torch's generator range)")
        need(self.num_kv_pages is None or (isinstance(self.num_kv_pages, int) and self.num_kv_pages >= 1),
             "num_kv_pages", "None (sized from memory) or an integer >= 1")
        need(self.async_scheduling is None or isinstance(self.async_scheduling, bool), "async_scheduling",
             "None (on for CUDA, off on a CPU), True or False")
        need(is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1, "tensor_parallel_size",
             "an integer >= 1 (one process per rank, one GPU per rank on CUDA)")
        need(is_int(self.recall_sample_every) and self.recall_sample_every >= 0, "recall_sample_every",
             "an integer >= 0 (0: off; N: measure attention recall every N-th decode step of a request)")
        need(is_int(self.auto_dense_below) and self.auto_dense_below >= 0, "auto_dense_below",
             "an integer >= 0 (prompt tokens below which an \"auto\" request decodes densely)")
        need(isinstance(self.auto_compact_on_pressure, bool), "auto_compact_on_pressure", "True or False")
        need(is_int(self.auto_compact_capacity) and self.auto_compact_capacity > PRESSURE_WINDOW,
             "auto_compact_capacity", f"an integer > {PRESSURE_WINDOW} (tokens a compacted request keeps per KV "
             "head, its observation window included)")


ENGINE_KNOBS = [f.name for f in fields(EngineConfig)
                if f.name not in ("model", "vllm_sparse_method", "method_config", "method", "hosted")]
# engine knobs of vllm_sparse_method="auto" only
AUTO_KNOBS = ("auto_dense_below", "auto_method", "auto_compact_on_pressure", "auto_compact_capacity")
