"""The tree's shape, checked: imports run one way (no module imports one that imports it back, at
any depth), and the generic layers name no method (methods act only through the cache manager's
hooks: docs/design.md)."""
import ast
import re
from pathlib import Path

import sparsevllm

ROOT = Path(sparsevllm.__file__).parent
METHODS = re.compile(r"(?i)(?:^|[^a-z])(snapkv|quest|omnikv|deltakv|hisparse)")
GENERIC = ["layers/attention.py", "models/*.py", "engine/*.py", "kernels/decode_attention.py",
           "kernels/prefill_attention.py"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """Package modules imported at module level (TYPE_CHECKING blocks included: a circle hidden from
    the interpreter is still one for a reader)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        blocks = [node] if not isinstance(node, ast.If) else node.body + node.orelse
        for stmt in blocks:
            if isinstance(stmt, ast.Import):
                found.update(a.name for a in stmt.names if a.name in modules)
            elif isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
                for a in stmt.names:   # `from pkg import module` imports the module
                    sub = f"{stmt.module}.{a.name}"
                    found.add(sub if sub in modules else stmt.module)
    return found & modules


def test_the_package_imports_one_way():
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {m: imports(p, set(files)) - {m} for m, p in files.items()}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)
    for m in sorted(graph):
        visit(m)


def code_words(path: Path) -> list[str]:
    """Names, attributes and string constants of a module, docstrings and comments left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    words = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            words.append(n.id)
        elif isinstance(n, ast.Attribute):
            words.append(n.attr)
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            words.append(n.name)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            words.append(n.value)
    return words


def test_generic_code_names_no_method():
    files = [p for pattern in GENERIC for p in sorted(ROOT.glob(pattern))]
    assert len(files) > 10
    named = {str(p.relative_to(ROOT)): sorted({w for w in code_words(p) if METHODS.search(w)}) for p in files}
    assert {f: w for f, w in named.items() if w} == {}
