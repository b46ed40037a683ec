"""Every test module has a unique basename: pytest's default import mode ("prepend", no __init__.py in tests/)
imports each as a top-level module, so two files named alike make collection fail for the whole suite. No file
imports a test module or conftest.py: shared helpers live in tests/helpers/."""

import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts)
    clashes = {name: sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob(name)) for name, n in names.items() if n > 1}
    assert not clashes, f"rename one of each: {clashes}"


def _imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``: c may be a module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_no_file_imports_a_test_module_or_conftest():
    """Helpers shared by test modules live in tests/helpers/ (fixtures in conftest.py): a test module imported by
    another runs its module-level code twice under two names, and its helpers change with its tests."""
    root = TESTS.parent
    sources = [p for top in (TESTS, root / "bench") for p in top.rglob("*.py") if "__pycache__" not in p.parts]
    bad = sorted(f"{p.relative_to(root)} imports {m}" for p in sources for m in _imported_modules(p)
                 if m.startswith("tests.") and (m.rsplit(".", 1)[-1].startswith("test_") or m == "tests.conftest"))
    assert not bad, "move the helpers to tests/helpers/: " + "; ".join(bad)
