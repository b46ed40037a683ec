"""The command verbs import no other verb, checked from the source (``ast``, nothing imported).

Each top-level entry of ``plait/commands`` is one verb: a module (``train.py``: ``plait train``) or a package
(``plan/``: ``plait plan``, ``plait plan --energy`` and ``plait energy``, with the plan's own helpers). A verb's
modules may import each other; what several verbs share sits below the verbs (``plait.measure``, ``plait.train``,
``plait.models``), so no module of one verb imports a module of another, lazily or not.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

COMMANDS = Path(__file__).resolve().parents[3] / "plait" / "commands"


def command_sources(root: Path = COMMANDS) -> dict[str, str]:
    """Path under ``plait/commands`` (``plan/command.py``) -> source text, of every module there."""
    return {str(path.relative_to(root)): path.read_text() for path in sorted(root.rglob("*.py"))}


def verb_of(relative: str) -> str | None:
    """The verb a module under ``plait/commands`` belongs to (``plan/command.py`` -> ``plan``); None for the
    package's own ``__init__.py``."""
    first = relative.split("/")[0]
    return None if first == "__init__.py" else first.removesuffix(".py")


def _imported(relative: str, node: ast.AST) -> list[str]:
    """The dotted names an import node brings in (``from a import b`` -> ``a.b``), relative ones resolved."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        package = ["plait", "commands", *relative.split("/")[:-1]]
        base = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [f"{base}.{alias.name}" for alias in node.names]


def verb_violations(sources: Mapping[str, str]) -> list[str]:
    """One message per import by a verb's module of another verb's module."""
    out = []
    for relative, text in sources.items():
        verb = verb_of(relative)
        for node in ast.walk(ast.parse(text, filename=relative)):
            for name in _imported(relative, node):
                parts = name.split(".")
                if parts[:2] != ["plait", "commands"] or len(parts) < 3:
                    continue
                target = parts[2]
                if verb is not None and target != verb:
                    out.append(f"plait/commands/{relative}:{node.lineno}: verb {verb!r} imports {name} of verb "
                               f"{target!r}; put what verbs share below them (plait.measure, plait.train, ...)")
    return out


def test_no_verb_imports_another_verb() -> None:
    violations = verb_violations(command_sources())
    assert not violations, "\n".join(violations)


def test_every_verb_of_the_command_line_is_found() -> None:
    verbs = {verb_of(relative) for relative in command_sources()} - {None}
    assert {"train", "plan", "profile", "simulate", "generate", "tune_ranks", "launch", "import_hf",
            "export_hf"} <= verbs, verbs


def test_the_checker_reports_a_verb_importing_another() -> None:
    sources = dict(command_sources())
    sources["tune_ranks.py"] += "\n\ndef bad():\n    from plait.commands.train import train_command\n"
    sources["plan/bad.py"] = "from plait.commands import profile\nfrom . import command\n"
    violations = verb_violations(sources)
    assert any(v.startswith("plait/commands/tune_ranks.py:") and "imports plait.commands.train.train_command of verb "
               "'train'" in v for v in violations), violations
    assert any(v.startswith("plait/commands/plan/bad.py:1: verb 'plan' imports plait.commands.profile of verb "
                            "'profile'") for v in violations), violations
    assert not any("plan.command" in v for v in violations), violations  # a verb's own modules may import each other
