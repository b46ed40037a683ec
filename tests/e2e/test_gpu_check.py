"""``bench/gpu_check.py`` (issue 14's prepared GPU check) runs end to end on CPU at its smallest size: the flex vs
SDPA check passes, the three training runs print their rows and plait's first-step loss equals the HF loop's, and the
executor runs 1F1B, ZB-H1 and ZB-H2 to the same loss and gradients."""

import re

from tests.helpers.cli import plait_on_ranks


def test_gpu_check_runs_on_cpu_at_the_smallest_size():
    # `python bench/gpu_check.py ...` in a process forked from the session's fork server (torch, transformers and
    # plait already imported: no interpreter start and imports, about 6 CPU-s)
    proc = plait_on_ranks(1, "bench/gpu_check.py", "--device", "cpu", "--models", "tiny", "--steps", "1", "--batch",
                          "2", limit_s=240, entry="tests.helpers.cli:script_rank")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "flex within max(3 x SDPA's error, 1e-05) of the reference's scale: True" in out
    rows = {name: re.search(rf"^{re.escape(name)}\s+([\d.]+)\s+(\d+)\s+([\d.]+)%\s+n/a\s+([\d.]+)\s+([\d.]+)$", out,
                            re.M) for name in ("plait FSDP2 + AC", "plait FSDP2", "HF loop")}
    assert all(rows.values()), out
    losses = {name: float(m.group(5)) for name, m in rows.items()}
    assert abs(losses["plait FSDP2 + AC"] - losses["HF loop"]) <= 2e-4 and abs(losses["plait FSDP2"] - losses["HF loop"]) <= 2e-4
    saved = {name: float(m.group(4)) for name, m in rows.items()}
    assert saved["plait FSDP2 + AC"] < saved["plait FSDP2"]  # checkpointing keeps less for the backward
    assert "first-step loss vs the HF loop within 0.0001: True" in out
    executor = {m.group(1): (int(m.group(2)), float(m.group(3))) for m in re.finditer(
        r"^(1f1b|zb_h1|zb_h2|zb_v)\s+(\d+)\s+[\d.]+\s+\d+\s+([\d.]+)\s+[\d.e+-]+$", out, re.M)}
    assert sorted(executor) == ["1f1b", "zb_h1", "zb_h2", "zb_v"], out
    assert executor["zb_h1"][0] == executor["zb_h2"][0] == executor["zb_v"][0] > executor["1f1b"][0]  # W actions too
    assert "zero-bubble schedules equal 1F1B: True" in out
    assert out.rstrip().splitlines()[-1].startswith("all checks passed: True")
