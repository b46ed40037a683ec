"""Every test module has a unique basename: pytest's default import mode ("prepend", no __init__.py in tests/)
imports each as a top-level module, so two files named alike make collection fail for the whole suite."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts)
    clashes = {name: sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob(name)) for name, n in names.items() if n > 1}
    assert not clashes, f"rename one of each: {clashes}"
