"""The commands, files and links of README.md and the guide pages (docs/*.md) stay true.

Every ``plait ...``, ``.venv/bin/plait ...``, ``torchrun ... -m plait.cli ...`` and ``python -m plait.cli ...``
command in a code block (and in inline code, when it has no placeholder such as ``...`` or ``[--f 1]``) is parsed
by the real command line's parser (the verb and every option must exist, written in full) and its job file is read
and validated with its ``--section.key=value`` overrides as the verb reads it (plait.cli.check_job_arguments, no
torch needed): a ``configs/`` file must exist, a user's own job (``job.toml``, ``myjob.toml``) is stood in for by
the demo's. ``make`` targets, ``bench/`` scripts and ``python -m`` modules must exist, TOML blocks may only name
real config fields, Python blocks import only what plait defines, and every relative link and every repository
path or ``plait.`` name in backticks must exist.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from plait.cli import _JOB_VERBS, build_parser, check_job_arguments, parse_command_line
from plait.config.loader import config_from_dict, read_config_data
from tests.helpers.jobs import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STAND_IN_JOB = "configs/demo.toml"  # checks the overrides of a command on a user's own job file
REPO_PREFIXES = ("plait/", "configs/", "bench/", "tests/", "docs/", "data/demo/")
PLACEHOLDER = re.compile(r"\.\.\.|<[^>]*>|\[-|\bN\b|\|")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Snippet:
    """One command line or code block of a page, with where it is (``page:line``)."""

    where: str
    text: str
    kind: str  # "command" (a shell line), "toml", "python"


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _shell_lines(block: str, first_line: int) -> list[tuple[int, str]]:
    """The block's command lines, continuation lines (``\\`` at the end) joined."""
    lines, pending, start = [], "", first_line
    for i, line in enumerate(block.splitlines()):
        if not pending:
            start = first_line + i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append((start, pending + line))
        pending = ""
    return [(n, line) for n, line in lines if line.strip()]


def _inline_spans(text: str) -> list[tuple[int, str]]:
    """Inline code spans outside fenced blocks, line breaks inside a span read as spaces."""
    blanked = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return [(_line_of(blanked, m.start()), re.sub(r"\s*\n\s*", " ", m.group(1)))
            for m in re.finditer(r"`([^`]+)`", blanked)]


def snippets() -> list[Snippet]:
    out = []
    for page in PAGES:
        text, name = page.read_text(), page.relative_to(ROOT).as_posix()
        for m in FENCE.finditer(text):
            lang, body, line = m.group(1), m.group(2), _line_of(text, m.start()) + 1
            if lang in ("bash", "sh", "shell"):
                out += [Snippet(f"{name}:{n}", cmd, "command") for n, cmd in _shell_lines(body, line)]
            elif lang in ("toml", "python"):
                out.append(Snippet(f"{name}:{line}", body, lang))
        for n, span in _inline_spans(text):
            if (_full_plait_command(span) or re.match(r"make \w", span)) and not PLACEHOLDER.search(span):
                out.append(Snippet(f"{name}:{n}", span, "command"))
    return out


def _full_plait_command(span: str) -> bool:
    """Whether inline code is a whole plait command (every required option of its verb given a value), not a
    mention of a verb or an option (``plait plan --energy``)."""
    try:
        words = shlex.split(span)
    except ValueError:
        return False
    argv = _plait_argv(words) if words else None
    verbs = _verb_parsers()
    if not argv or argv[0] not in verbs:
        return False
    required = {a.option_strings[0] for a in verbs[argv[0]]._actions if a.required}
    given = {w for w, value in zip(argv, argv[1:] + ["--"]) if not value.startswith("--")}
    return required <= given


def _verb_parsers() -> dict:
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def _words(command: str) -> list[list[str]]:
    """The simple commands of a shell line (split at ``&&`` and ``;``), comments dropped."""
    words = shlex.split(command, comments=True)
    parts, current = [], []
    for w in words:
        if w in ("&&", ";", "||"):
            parts.append(current)
            current = []
        else:
            current.append(w)
    return [p for p in parts + [current] if p]


def _plait_argv(words: list[str]) -> list[str] | None:
    """The arguments after ``plait`` of a command that runs plait's command line, else None."""
    if Path(words[0]).name == "plait":
        return words[1:]
    if "-m" in words and (Path(words[0]).name == "torchrun" or Path(words[0]).name.startswith("python")):
        i = words.index("-m")
        if words[i + 1:i + 2] == ["plait.cli"]:
            return words[i + 2:]
    return None


def check_plait(argv: list[str]) -> None:
    """Parse ``argv`` as ``plait`` does and check its job file and overrides; fails naming the problem."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args, overrides = parse_command_line(argv)
    except SystemExit:
        pytest.fail(f"plait {' '.join(argv)}: the command line parser refuses it: {err.getvalue().strip()}")
    if args.command in _JOB_VERBS and not (ROOT / args.config).is_file():
        assert not args.config.startswith("configs/"), f"{args.config} does not exist"
        args.config = STAND_IN_JOB
    if args.command in _JOB_VERBS:
        args.config = str(ROOT / args.config)
    try:
        check_job_arguments(args, overrides, run_folder=False)
    except (ValueError, FileNotFoundError) as exc:
        pytest.fail(f"plait {' '.join(argv)}: {exc}")


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w./-]+):", (ROOT / "Makefile").read_text(), re.M))


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def check_command(command: str) -> None:
    for words in _words(command):
        argv = _plait_argv(words)
        if argv is not None:
            check_plait(argv)
        elif words[0] == "make":
            targets = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
            missing = set(targets) - _make_targets()
            assert not missing, f"no make target {sorted(missing)}"
        elif "-m" in words and Path(words[0]).name.startswith("python"):
            module = words[words.index("-m") + 1]
            if module.startswith("plait"):
                assert _module_file(module), f"no module {module}"
        for w in words:
            if w.startswith("bench/") and w.endswith(".py"):
                assert (ROOT / w).is_file(), f"{w} does not exist"


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def check_toml(body: str) -> None:
    """A job-file fragment names only real config fields of the right types (merged into the demo job)."""
    fragment = tomllib.loads(body)
    config_from_dict(_merge(read_config_data(ROOT / STAND_IN_JOB), fragment))


def check_python(body: str) -> None:
    """Every ``from plait... import name`` names a module of the repository that defines ``name``."""
    for node in ast.walk(ast.parse(body)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plait"):
            path = _module_file(node.module)
            assert path, f"no module {node.module}"
            for alias in node.names:
                assert _defines(path, alias.name), f"{node.module} defines no {alias.name}"


def _defines(path: Path, name: str, nested: bool = False) -> bool:
    """Whether the module file defines ``name`` at its top level (or, ``nested``, anywhere: a method)."""
    indent = r"[ \t]*" if nested else ""
    pattern = rf"^{indent}(class|def) {re.escape(name)}\b|^{indent}{re.escape(name)}\s*[:=]"
    return re.search(pattern, path.read_text(), re.M) is not None


SNIPPETS = snippets()


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.where)
def test_documented_command_and_block_are_true(snippet: Snippet, monkeypatch):
    monkeypatch.chdir(ROOT)
    {"command": check_command, "toml": check_toml, "python": check_python}[snippet.kind](snippet.text)


def test_the_documented_commands_are_found():
    commands = [s for s in SNIPPETS if s.kind == "command"]
    assert any(s.where.startswith("README.md") and "make test" in s.text for s in commands)
    assert sum(any(_plait_argv(w) for w in _words(s.text)) for s in commands) >= 40


def _dotted_name_exists(dotted: str) -> bool:
    """``plait.a.b.Name.attr``: the longest module prefix is a file of the repository defining ``Name`` (and
    ``attr`` within it)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path:
            return all(_defines(path, name, nested=i > cut) for i, name in enumerate(parts[cut:], cut))
    return False


def test_links_and_paths_exist():
    """Every relative link resolves (a ``#anchor`` to a heading of its page), and every repository path
    (``plait/``, ``configs/``, ``bench/``, ``tests/``, ``docs/``, ``data/demo/``) or ``plait.`` name in backticks
    exists."""
    problems = []
    for page in PAGES:
        text, name = page.read_text(), page.relative_to(ROOT).as_posix()
        for m in re.finditer(r"\]\(([^)\s]+)\)", FENCE.sub("", text)):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                problems.append(f"{name}: link {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{name}: link {target}: no such heading")
        for n, span in _inline_spans(text):
            for word in span.split():
                word = word.split("(")[0].strip(",;:)'\"")
                if "<" in word or "*" in word or "{" in word:
                    continue
                if word.startswith(REPO_PREFIXES) and not (ROOT / word).exists():
                    problems.append(f"{name}:{n}: {word} does not exist")
                if re.fullmatch(r"plait(\.\w+){2,}", word) and not _dotted_name_exists(word):
                    problems.append(f"{name}:{n}: {word} names nothing in plait/")
    assert not problems, "\n".join(problems)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a page: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
