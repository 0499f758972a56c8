"""Start-up: `import sparsevllm` and every entry point's --help answer without importing torch (it
costs seconds on a busy machine); the engine's own imports wait until an LLM is built; a CPU engine's
thread count follows the load it starts under, not an earlier engine's."""
import subprocess
import sys

import pytest

ENTRY_POINTS = ["sparsevllm", "sparsevllm.serve", "sparsevllm.regression", "sparsevllm.tools.train_deltakv",
                "sparsevllm.tools.omnikv_calibrate", "sparsevllm.report"]


def imported(args: list[str]) -> set[str]:
    out = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_imports_no_torch(module):
    assert "torch" not in imported(["-m", module, "--help"])


def test_import_sparsevllm_imports_no_torch_until_an_llm_is_asked_for():
    assert "torch" not in imported(["-c", "import sparsevllm; sparsevllm.available_methods()"])
    assert "torch" in imported(["-c", "from sparsevllm import LLM"])


def test_a_later_engine_is_not_held_to_an_earlier_engines_thread_count(monkeypatch):
    """cpu_threads: an engine started under load takes one thread; a later engine of the same process
    (the harness starts one per variant) starts again from torch's count when the load is gone, while a
    caller's own torch.set_num_threads still caps it."""
    import torch

    from sparsevllm.engine import model_runner as mr
    monkeypatch.setattr(mr, "_threads_before_engines", None)
    monkeypatch.setattr(mr, "_threads_set", None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(mr.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        monkeypatch.setattr(mr, "busy_cores", lambda cores: 3.2)
        n, _ = mr.cpu_threads()
        assert n == 1
        mr.set_cpu_threads(n)
        monkeypatch.setattr(mr, "busy_cores", lambda cores: 0.1)
        assert mr.cpu_threads()[0] == 4     # not "torch has one": that one was the engine's
        torch.set_num_threads(2)            # the caller's choice stands
        assert mr.cpu_threads()[0] == 2
    finally:
        torch.set_num_threads(before)


def test_shutdown_frees_the_engine_while_the_llm_lives(tiny_model):
    """A script that builds engine after engine (the benchmarks, the harness) keeps its `llm` name bound
    while the next LLM is built: shutdown() must free the weights and the KV pool now (on an H100 the
    second 128K engine ran out of memory before it did), and the LLM then says it can't generate."""
    import gc
    import weakref

    from sparsevllm import LLM, SamplingParams
    llm = LLM(tiny_model("llama"), vllm_sparse_method="quest", num_kv_pages=32)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2), use_tqdm=False)
    model = weakref.ref(llm.engine.model_runner.model)
    pool = weakref.ref(llm.engine.cache_manager.pool)
    llm.shutdown()
    gc.collect()
    assert model() is None and pool() is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()   # twice is fine
