"""Helpers of several test modules, taken from tests/e2e/test_cli.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from tests.helpers.jobs import ROOT, demo_records, write_jsonl


def toml_value(v) -> str:
    return json.dumps(v)


def write_job(tmp_path) -> str:
    train = write_jsonl(tmp_path / "train.jsonl", demo_records("train", limit=12))
    val = write_jsonl(tmp_path / "val.jsonl", demo_records("val", limit=6))
    text = (ROOT / "configs" / "demo.toml").read_text()
    text = text.replace('"data/demo/train.jsonl"', toml_value(str(train))).replace(
        '"data/demo/val.jsonl"', toml_value(str(val))).replace(
        '"data/demo/tokenizer"', toml_value(str(ROOT / "data/demo/tokenizer"))).replace(
        '"runs/demo"', toml_value(str(tmp_path / "run")))
    job = tmp_path / "job.toml"
    job.write_text(text)
    return str(job)


def cli_rank(logs: str, *argv: str) -> None:
    """``plait <argv>`` in this process (a rank started by ``spawning.run_main``, or the one process of
    :func:`plait`) as ``python -m plait.cli <argv>`` runs it: in the repository root, ``sys.argv`` as that command
    sets it, its file descriptors 1 and 2 (Python, C++ and child processes alike) in ``<logs>.<rank>.out``/``.err``,
    its exit code in ``<logs>.<rank>.rc``: ``main``'s return value, a ``SystemExit``'s code (argparse's usage error:
    2), or 1 with the traceback on stderr when it raises."""
    from plait.cli import main

    _as_process(logs, [str(ROOT / "plait" / "cli.py"), *argv], lambda: main(list(argv)))


def script_rank(logs: str, script: str, *argv: str) -> None:
    """``python <script> <argv>`` (a path from the repository root, e.g. a ``bench/`` script) in this process, as
    :func:`cli_rank` runs ``plait``: run as ``__main__`` with that ``sys.argv``, from the repository root, its
    output and exit code (``sys.exit``'s) in ``<logs>.<rank>.out``/``.err``/``.rc``."""
    import runpy

    def run() -> int:
        runpy.run_path(str(ROOT / script), run_name="__main__")
        return 0  # the script ended without sys.exit

    _as_process(logs, [script, *argv], run)


def _as_process(logs: str, argv: list[str], run) -> None:
    """``run()`` as a process's whole program (:func:`cli_rank`): ``sys.argv`` set to ``argv``, from the repository
    root, file descriptors 1 and 2 in ``<logs>.<rank>.out``/``.err``, the exit code in ``<logs>.<rank>.rc``."""
    rank = os.environ.get("RANK", "0")
    os.chdir(ROOT)
    sys.argv = argv
    code = 1
    with open(f"{logs}.{rank}.out", "w") as out, open(f"{logs}.{rank}.err", "w") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = run()
        except SystemExit as exc:  # what the interpreter makes of sys.exit(code)
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - reported through the exit code and stderr, as a process would
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    Path(f"{logs}.{rank}.rc").write_text(str(code))


def plait_on_ranks(nproc: int, *args: str, limit_s: float = 300, logs: Path | None = None,
                   entry: str = "tests.helpers.cli:cli_rank") -> subprocess.CompletedProcess:
    """``plait <args>`` on ``nproc`` processes with the variables ``torchrun --nproc_per_node=nproc`` sets (one
    process: none, as ``python -m plait.cli``), forked from the test session's fork server (``spawning.run_main``:
    torch, transformers and plait's trainers already imported, instead of the seconds an interpreter takes to import
    them per process), to their end: a finished process with the largest exit code and the ranks' stdout and stderr
    (rank 0's first). ``logs``: where the ranks' outputs are kept (``<logs>.<rank>.out``/``.err``/``.rc``; default:
    a temporary folder, removed). ``entry``: ``module:function`` each rank runs, :func:`cli_rank` or a function that
    patches plait before calling it. Fails the test after ``limit_s`` seconds."""
    from tests.distributed.spawning import run_main

    folder = None if logs is not None else Path(tempfile.mkdtemp(prefix="plait-cli-"))
    logs = logs if logs is not None else folder / "cli"
    try:
        module, function = entry.split(":")
        run_main(module, [str(logs), *args], nproc, limit_s, f"plait {' '.join(args[:1])} on {nproc} process(es)",
                 function=function)
        out = [Path(f"{logs}.{r}.{kind}").read_text() for kind in ("rc", "out", "err") for r in range(nproc)]
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return subprocess.CompletedProcess(["plait", *args], max(map(int, out[:nproc])), "".join(out[nproc:2 * nproc]),
                                       "".join(out[2 * nproc:]))


def plait(*args: str, limit_s: float = 300) -> subprocess.CompletedProcess:
    """``plait <args>`` in one process (:func:`plait_on_ranks`), to its end."""
    return plait_on_ranks(1, *args, limit_s=limit_s)
