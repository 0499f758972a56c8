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
    hooks = set(re.findall(r"`(\w+)`", skill_text()))
    for hook in ("on_kv_stored", "build_decode_view", "observe_prefill_queries", "chunk_size", "on_step_begin",
                 "on_step_end", "allocate_storage", "store_target"):
        assert hook in hooks and hasattr(CacheManager, hook), hook


DESIGN = ROOT / "docs" / "design.md"
HELPERS = {"pages_for", "admit_len", "seq_admit_len", "last_slots", "num_pages", "request_config"}   # for methods to call


def test_the_design_hook_table_lists_every_hook_with_its_arguments():
    """docs/design.md is the contract: its hook table names every overridable method of CacheManager
    with the arguments base.py takes, and nothing base.py lacks."""
    import inspect

    from sparsevllm.engine.cache_manager.base import CacheManager
    rows = dict(re.findall(r"^\| `(\w+)\(([^`]*)\)` \|", DESIGN.read_text(), re.M))
    hooks = {name for name, _ in inspect.getmembers(CacheManager) if not name.startswith("_")
             and inspect.isroutine(getattr(CacheManager, name)) and name not in HELPERS}
    assert set(rows) == hooks, f"in the table only: {set(rows) - hooks}; in base.py only: {hooks - set(rows)}"
    for name, args in rows.items():
        params = [p for p in inspect.signature(getattr(CacheManager, name)).parameters if p not in ("self", "cls")]
        assert [a.strip() for a in args.split(",") if a.strip()] == params, f"design: {name}({args}); base.py: {params}"
    assert all(h in DESIGN.read_text() for h in HELPERS - {"num_pages", "seq_admit_len"})


def test_types_and_flags_named_by_the_skill_exist():
    """DecodeView's fields, every Capabilities flag, and the class attributes a method must set."""
    from dataclasses import fields

    from sparsevllm.engine.cache_manager.base import Capabilities, CacheManager
    from sparsevllm.engine.step import DecodeView
    text = skill_text()
    view = re.search(r"`DecodeView\(([^`]*)\)`", text)
    assert view, "the skill should spell out DecodeView's fields"
    names = [a.split()[0] for a in re.sub(r"\[[^\]]*\]", "", view.group(1)).split(",")]   # shapes aside
    assert names == [f.name for f in fields(DecodeView)][:len(names)]
    flags = {f.name for f in fields(Capabilities)}
    assert flags <= set(re.findall(r"(\w+)=", text)), "every Capabilities flag should be explained"
    for flag in re.findall(r"`Capabilities\(([^`]*)\)`", text):
        assert {a.split("=")[0].strip() for a in flag.split(",") if "=" in a} <= flags
    for attr in ("config_cls", "method_name", "capabilities", "decode_kv_tokens_read"):
        assert attr in text and hasattr(CacheManager, attr)


def test_tests_the_skill_names_exist():
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for name in re.findall(r"`(test_\w+|graph_shaped)`", skill_text()):
        assert f"def {name}(" in tests, name
