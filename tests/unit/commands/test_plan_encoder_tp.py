"""``plait plan --encoder-tp``: the flag reaches the search with each encoder branch bounded by the largest power of
two dividing its tower's heads (the demo's towers: 4 heads each), and a plan without a TP group says it searched
them; with the job's own ``parallel.tp`` they are not searched, and the line says why."""

from __future__ import annotations

import contextlib
import io

from plait.cli import main
from tests.helpers.jobs import ROOT

JOB = ROOT / "configs" / "demo_pp.toml"


def _plan(*extra: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", "--config", str(JOB), "--devices", "4", "--device", "h100", "--encoder-tp",
              "--one-stage-per-rank", *extra])
    return out.getvalue()


def test_encoder_tp_is_searched_up_to_the_heads():
    text = _plan()
    assert "encoder tensor-parallel degrees: searched (at most {'vision': 4, 'audio': 4}), none faster" in text
    assert "encoder_tp" not in text.split("to run this plan")[-1]  # no TP group planned: none written


def test_encoder_tp_is_not_searched_beside_the_jobs_own_tp():
    assert "encoder tensor-parallel degrees not searched (the job's own parallel.tp = 2)" in _plan("--parallel.tp=2")
