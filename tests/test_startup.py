"""Start-up: `import sparsevllm` and every entry point's --help answer without importing torch (it
costs seconds on a busy machine); the engine's own imports wait until an LLM is built."""
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
