"""``plait plan`` on a job with training data: macro-batch statistics (how much each module's total work varies
between global batches) and a plan for the expected global batch."""

from __future__ import annotations

import math
import re

import pytest

from plait.config.loader import load_config
from plait.data.loader import GlobalBatchLoader
from plait.commands.plan.command import DEFAULT_MACROBATCHES, dataset_metadata
from tests.helpers.cli import plait, write_job

OVERRIDES = ["--train.global_batch_size=6", "--train.microbatch_size=2", "--train.seed=3"]


def brute_force_totals(metas, coeffs, batch: int, count: int, seed: int) -> dict[str, list[float]]:
    """Per module, the total work of each of ``count`` full global batches in the loader's order, summed sample
    by sample from the documented cost model (encoder: per item ``cost(placeholders)``; LLM: ``cost(length)``)."""
    loader = GlobalBatchLoader(len(metas), batch, seed=seed)
    batches, epoch = [], 0
    while len(batches) < count:
        order = loader.epoch_order(epoch).tolist()
        batches += [order[k * batch:(k + 1) * batch] for k in range(len(order) // batch)][: count - len(batches)]
        epoch += 1
    totals: dict[str, list[float]] = {name: [] for name in coeffs}
    for rows in batches:
        for name in coeffs:
            if name == "llm":
                totals[name].append(sum(coeffs["llm"].cost(metas[i].length) for i in rows))
            else:
                totals[name].append(sum(coeffs[name].cost(n) for i in rows for enc, n in metas[i].items if enc == name))
    return totals


def test_plan_prints_macrobatch_variation_and_plans_for_the_expected_batch(tmp_path):
    job = write_job(tmp_path)  # 12 demo samples: images, audio clips, image+audio and text
    proc = plait("plan", "--config", job, "--devices", "2", "--device", "cpu-preset", *OVERRIDES,
                 f"--macrobatches={DEFAULT_MACROBATCHES}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"global batch 6, {DEFAULT_MACROBATCHES} batches" in out

    cfg = load_config(job, OVERRIDES)
    metas, coeffs = dataset_metadata(cfg)
    assert len(metas) == 12
    totals = brute_force_totals(metas, coeffs, 6, DEFAULT_MACROBATCHES, seed=3)
    for name, values in totals.items():
        row = re.search(rf"^{re.escape(name)}\s.*$", out, re.M)
        assert row, f"no row for {name} in:\n{out}"
        cells = row.group(0).split("|")[2].split()  # expected, mean, cv, cv 1/sqrtB, min, max
        mean = sum(values) / len(values)
        cv = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / mean
        assert float(cells[1]) == float(f"{mean:.4g}")
        assert float(cells[2].rstrip("%")) == round(100 * cv, 2)
        assert float(cells[4]) == float(f"{min(values):.4g}") and float(cells[5]) == float(f"{max(values):.4g}")
        assert cv > 0.001  # batches of 6 out of 12 mixed samples do vary
    llm_tokens = round(2 * sum(m.length for m in metas) / len(metas))
    assert re.search(rf"planned for the expected global batch: .*llm {llm_tokens} tokens", out)
    assert "layout" in out and "iteration" in out  # the plan itself follows


def test_macrobatches_are_off_by_default(tmp_path):
    import io

    from plait.commands.plan.command import plan_command

    job = write_job(tmp_path)
    plain, flagged = io.StringIO(), io.StringIO()
    plan_command(job, 1, overrides=OVERRIDES, device="cpu-preset", out=plain)
    plan_command(job, 1, overrides=OVERRIDES, device="cpu-preset", out=flagged, macrobatches=4)
    assert "macro-batch" not in plain.getvalue()
    assert "global batch 6, 4 batches" in flagged.getvalue()
    with pytest.raises(ValueError, match="macrobatches must be an integer >= 0"):
        plan_command(job, 1, overrides=OVERRIDES, device="cpu-preset", out=io.StringIO(), macrobatches=-1)
