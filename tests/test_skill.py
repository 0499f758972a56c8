"""The add-sparse-method skill names only files and commands that exist in this repository."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKILL = ROOT / "skills" / "add-sparse-method"


def skill_text() -> str:
    return "\n".join(p.read_text() for p in sorted(SKILL.rglob("*.md")))


def test_every_repository_path_in_the_skill_exists():
    paths = set(re.findall(r"(?<![\w/.])((?:src|scripts|tests|skills)/[\w./-]+\.(?:py|md|json))", skill_text()))
    assert paths, "the skill should name repository files"
    missing = sorted(p for p in paths if "<method>" not in p and not (ROOT / p).exists())
    assert not missing, f"skill names missing files: {missing}"
    for ref in ("references/file-map.md", "references/quest-pattern.md", "references/cross-layer-pattern.md"):
        assert (SKILL / ref).exists()


def test_every_command_in_the_skill_exists():
    text = skill_text()
    assert "python -m sparsevllm.regression" in text and "bench_sparse_vllm.py" in text
    for module in ("sparsevllm.regression",):
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                             cwd=ROOT, timeout=120)
        assert out.returncode == 0, out.stderr
    for script in ("scripts/benchmarks/bench_sparse_vllm.py", "scripts/benchmarks/profile_decode.py"):
        assert (ROOT / script).exists()
    for flag in ("--methods", "--lengths", "--batch_sizes", "--output_len", "--out_dir", "--model_path"):
        assert flag in (ROOT / "scripts/benchmarks/bench_sparse_vllm.py").read_text()
    for flag in ("--method", "--batch", "--length"):
        assert flag in (ROOT / "scripts/benchmarks/profile_decode.py").read_text()


def test_hooks_named_by_the_skill_exist_on_the_base_class():
    from sparsevllm.engine.cache_manager.base import CacheManager
    hooks = set(re.findall(r"`(\w+)\(", skill_text()))
    for hook in ("on_kv_stored", "build_decode_view", "observe_prefill_queries", "chunk_size", "on_step_end"):
        assert hook in hooks and hasattr(CacheManager, hook)
