"""The shipped examples and docs read `RequestOutput` through its attributes: its old dict keys
still work but warn, and an example is what a new user copies (issue #49)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The dict keys the earlier API returned (sparsevllm/outputs.py), spelled out here independently.
OLD_KEYS = ("text", "token_ids", "prompt_token_ids", "finish_reason", "error", "metrics")
OLD_ACCESS = re.compile(r"""\[\s*['"](?:{0})['"]\s*\]|\.get\(\s*['"](?:{0})['"]""".format("|".join(OLD_KEYS)))


def shipped_files() -> list[Path]:
    return sorted([*ROOT.glob("examples/*"), *ROOT.glob("skills/**/*.md"),
                   ROOT / "src" / "sparsevllm" / "regression" / "README.md"])


def test_the_pattern_finds_the_old_dict_access():
    for old in ['out["text"]', "out['prompt_token_ids']", "outs[0][ 'finish_reason' ]", 'out.get("metrics")']:
        assert OLD_ACCESS.search(old), old
    for new in ["out.outputs[0].text", "out.prompt_token_ids", "out.metrics", 'row["status"]']:
        assert not OLD_ACCESS.search(new), new


def test_examples_and_docs_use_request_output_attributes():
    files = shipped_files()
    assert ROOT / "examples" / "long_context_methods.py" in files
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for path in files if path.is_file()
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if OLD_ACCESS.search(line)]
    assert hits == [], "deprecated RequestOutput dict access (use out.outputs[0].text, ...):\n" + "\n".join(hits)
