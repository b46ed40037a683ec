"""The layering of plait, checked from the source (``ast``, nothing imported).

``ALLOWED_IMPORTS`` is the rule, as data: for each top-level part of plait (a subpackage, or ``cli`` for
``plait/cli.py``), the other parts its modules may import. Imports run downward only::

    cli -> commands -> measure -> train -> parallel -> models -> data / attention -> config -> planner

``planner`` imports nothing of plait outside itself (plans are data, computed by pure functions); ``config``
validates names the planner defines (layouts, schedules, microbatch methods), so it sits just above it;
``attention`` never imports ``parallel`` (context parallelism reaches attention through the ``plait_cp``
object it passes, see ``plait.attention.interface``); ``models`` never imports ``train``, ``parallel`` or
``commands``; ``data`` never imports ``models``, ``train``, ``parallel`` or ``commands``; ``measure`` (profilers,
link and host measurement, the profile store) builds what it times from the training loop's parts and is imported
by the verbs only; only ``cli`` imports ``commands``, and nothing imports ``cli``; ``cli`` may import ``train`` too (it
reads ``train.job_file`` only, to refuse a bad job file before torch loads).

Every import counts: module level, inside functions (lazy), under ``TYPE_CHECKING``, absolute and relative.
The same walk also refuses any import cycle, between modules and between top-level parts.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "plait"

ALLOWED_IMPORTS: dict[str, frozenset[str]] = {
    "cli": frozenset({"commands", "train"}),
    "commands": frozenset({"measure", "train", "parallel", "models", "data", "attention", "config", "planner"}),
    "measure": frozenset({"train", "parallel", "models", "data", "attention", "config", "planner"}),
    "train": frozenset({"parallel", "models", "data", "attention", "config", "planner"}),
    "parallel": frozenset({"models", "data", "attention", "config", "planner"}),
    "models": frozenset({"data", "attention", "config", "planner"}),
    "data": frozenset({"config", "planner"}),
    "attention": frozenset({"config", "planner"}),
    "config": frozenset({"planner"}),
    "planner": frozenset(),
}
"""Top-level part of plait -> the other parts it may import (its own modules always)."""

FORBIDDEN_OUTSIDE: dict[str, frozenset[str]] = {
    "planner": frozenset({"torch", "os", "pathlib", "shutil", "subprocess", "multiprocessing", "transformers"}),
}
"""Top-level part of plait -> packages from outside plait it may not import: the planner touches no tensors, files,
processes or models (plans are plain data)."""


@dataclass(frozen=True)
class Import:
    """One import of a plait module: ``source`` (dotted module) imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: str
    line: int


def module_sources(root: Path = PACKAGE_ROOT) -> dict[str, tuple[str, str]]:
    """Dotted module name -> (path relative to the project, source text) of every module under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = (str(path.relative_to(root.parent)), path.read_text())
    return out


def _resolve(name: str, modules: Iterable[str]) -> str:
    """The longest known module that ``name`` (a dotted name, maybe ``module.attribute``) starts with other than
    ``plait`` itself; ``name`` unchanged when there is none (a module that does not exist still has a part)."""
    known = set(modules)
    parts = name.split(".")
    for end in range(len(parts), 1, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return name


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved against ``module``)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    anchor = package[: len(package) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def outside_violations(sources: Mapping[str, tuple[str, str]],
                       forbidden: Mapping[str, frozenset[str]] = FORBIDDEN_OUTSIDE) -> list[str]:
    """One message per import of a package from outside plait that ``forbidden`` refuses to the module's part."""
    out = []
    for module, (path, text) in sources.items():
        refused = forbidden.get(part_of(module) or "", frozenset())
        for node in ast.walk(ast.parse(text, filename=path)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[0] in refused:
                    out.append(f"{path}:{node.lineno}: {module} imports {name}: plait.{part_of(module)} may not "
                               f"import {sorted(refused)}")
    return out


def module_imports(module: str, path: str, source: str, modules: Mapping[str, object]) -> list[Import]:
    """Every import of a plait module in ``source`` (all nesting levels), resolved to known modules."""
    is_package = path.endswith("__init__.py")
    found: dict[tuple[str, int], Import] = {}
    for node in ast.walk(ast.parse(source, filename=path)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node)
            names = [f"{base}.{alias.name}" for alias in node.names] if base else []
        for name in names:
            if name == "plait" or name.startswith("plait."):
                target = _resolve(name, modules)
                if target != module:
                    found.setdefault((target, node.lineno), Import(module, target, path, node.lineno))
    return list(found.values())


def part_of(module: str) -> str | None:
    """The top-level part of a dotted plait module (``plait.planner.search.layout`` -> ``planner``); None for ``plait``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_violations(imports: Iterable[Import], allowed: Mapping[str, frozenset[str]] = ALLOWED_IMPORTS) -> list[str]:
    """One message per import that crosses parts against ``allowed`` (a part missing from it is a violation)."""
    out = []
    for imp in imports:
        src, dst = part_of(imp.source), part_of(imp.target)
        if src is None or dst is None or src == dst:
            continue
        if src not in allowed:
            out.append(f"{imp.path}:{imp.line}: plait.{src} is not in ALLOWED_IMPORTS (imports {imp.target})")
        elif dst not in allowed[src]:
            rule = (f"may import only {', '.join(sorted(allowed[src]))} of plait" if allowed[src]
                    else "may import nothing of plait outside itself")
            out.append(f"{imp.path}:{imp.line}: {imp.source} imports {imp.target}: plait.{src} {rule} "
                       "(ALLOWED_IMPORTS)")
    return out


def find_cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (or a node with a self edge), each as a sorted
    list (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges.get(node, ()):
                    out.append(sorted(component))
    return out


def cycle_messages(imports: Iterable[Import]) -> list[str]:
    """One message per import cycle between modules, and one per cycle between top-level parts, naming the
    imports (file:line) that close it."""
    imports = list(imports)
    out = []
    for level, key in (("modules", lambda m: m), ("top-level parts", part_of)):
        edges: dict[str, set[str]] = {}
        where: dict[tuple[str, str], list[str]] = {}
        for imp in imports:
            a, b = key(imp.source), key(imp.target)
            if a is None or b is None or a == b:
                continue
            edges.setdefault(a, set()).add(b)
            where.setdefault((a, b), []).append(f"{imp.path}:{imp.line}")
        where = {edge: places[:3] + (["..."] if len(places) > 3 else []) for edge, places in where.items()}
        for component in find_cycles(edges):
            members = set(component)
            links = [f"{a} -> {b} ({', '.join(where[(a, b)])})" for a in component for b in sorted(edges[a])
                     if b in members]
            out.append(f"import cycle between {level} {component}: " + "; ".join(links))
    return out


def all_imports(sources: Mapping[str, tuple[str, str]]) -> list[Import]:
    """Every plait import of every module in ``sources`` (as ``module_sources`` returns)."""
    return [imp for module, (path, text) in sources.items() for imp in module_imports(module, path, text, sources)]


# ----- the tests ---------------------------------------------------------------------------------------------
def test_every_part_of_plait_is_in_the_table() -> None:
    parts = {part_of(m) for m in module_sources()} - {None}
    assert parts <= set(ALLOWED_IMPORTS), sorted(parts - set(ALLOWED_IMPORTS))


def test_layers_import_only_downward() -> None:
    violations = layer_violations(all_imports(module_sources()))
    assert not violations, "layering violations:\n" + "\n".join(violations)


def test_the_planner_touches_no_tensors_files_or_processes() -> None:
    violations = outside_violations(module_sources())
    assert not violations, "\n".join(violations)
    bad = outside_violations(_synthetic({"plait.planner.bad": "def f():\n    import torch.distributed as dist\n"}))
    assert bad == ["plait/planner/bad.py:2: plait.planner.bad imports torch.distributed: plait.planner may not import "
                   "['multiprocessing', 'os', 'pathlib', 'shutil', 'subprocess', 'torch', 'transformers']"]


def test_no_import_cycles() -> None:
    cycles = cycle_messages(all_imports(module_sources()))
    assert not cycles, "\n".join(cycles)


def _synthetic(files: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """``module_sources`` of the real tree plus synthetic modules (dotted name -> source)."""
    sources = module_sources()
    for name, text in files.items():
        sources[name] = (name.replace(".", "/") + ".py", text)
    return sources


def test_the_checker_reports_a_forbidden_import() -> None:
    sources = _synthetic({
        "plait.planner.bad": "import math\n\n\ndef f():\n    from plait.train import trainer\n    return trainer\n",
        "plait.attention.bad": "from ..parallel.context import CPShard\n",
        "plait.data.bad": "import plait.models.registry as registry\n",
        "plait.train.bad": "from plait.commands.plan.command import plan_command\n",
        "plait.train.bad_measure": "from plait.measure import job_profile\n",
        "plait.measure.bad": "def f():\n    from plait.commands.plan.command import plan_command\n",
    })
    violations = layer_violations(all_imports(sources))
    assert ("plait/planner/bad.py:5: plait.planner.bad imports plait.train.trainer: plait.planner may import nothing "
            "of plait outside itself (ALLOWED_IMPORTS)") in violations, violations
    assert ("plait/attention/bad.py:1: plait.attention.bad imports plait.parallel.context: plait.attention may import "
            "only config, planner of plait (ALLOWED_IMPORTS)") in violations, violations
    assert any(v.startswith("plait/attention/bad.py:1: plait.attention.bad imports plait.parallel.context")
               for v in violations), violations
    assert any(v.startswith("plait/data/bad.py:1: plait.data.bad imports plait.models.registry") for v in violations)
    assert any(v.startswith("plait/train/bad.py:1: plait.train.bad imports plait.commands.plan.command")
               for v in violations)
    assert any(v.startswith("plait/train/bad_measure.py:1: plait.train.bad_measure imports plait.measure.job_profile")
               for v in violations), violations
    assert ("plait/measure/bad.py:2: plait.measure.bad imports plait.commands.plan.command: plait.measure may import "
            "only attention, config, data, models, parallel, planner, train of plait (ALLOWED_IMPORTS)") in violations


def test_the_checker_reports_a_cycle() -> None:
    sources = _synthetic({
        "plait.planner.cyc_a": "from plait.planner import cyc_b\n",
        "plait.planner.cyc_b": "def f():\n    from .cyc_a import x\n",
    })
    cycles = cycle_messages(all_imports(sources))
    assert any("import cycle between modules ['plait.planner.cyc_a', 'plait.planner.cyc_b']" in c
               and "plait/planner/cyc_b.py:2" in c for c in cycles), cycles


MAX_LINES = 600
"""The review rule: no module of plait longer than this."""


def long_files(root: Path = PACKAGE_ROOT, limit: int = MAX_LINES) -> list[str]:
    """``path: N lines`` of every Python file under ``root`` longer than ``limit`` lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append(f"{path.relative_to(root.parent)}: {n} lines (at most {limit})")
    return out


def test_no_file_of_plait_is_over_600_lines(tmp_path) -> None:
    assert long_files() == []
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "pkg" / "small.py").write_text("x = 1\n" * MAX_LINES)
    assert long_files(tmp_path / "pkg") == [f"pkg/big.py: {MAX_LINES + 1} lines (at most {MAX_LINES})"]
