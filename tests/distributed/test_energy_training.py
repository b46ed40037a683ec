"""``plait train`` of a PP=2 job with ``[energy] plan`` under torchrun (gloo, CPU): the run trains, and its measured
timeline (``timeline.json``, last step) carries exactly the plan's frequency for every action of both ranks.
Image and text records only, and no loader workers: the run exercises the energy path, not the data path."""

from __future__ import annotations

from plait.planner.energy.types import ActionFrequency, EnergyPlan, FrontierPoint, action_label
from plait.train.metrics import read_metrics
from plait.train.plots import read_chrome_trace
from tests.helpers.jobs import demo_records, write_jsonl
from tests.helpers.pipeline_training import job_dict, torchrun_train


def test_plait_train_pp2_with_an_energy_plan(tmp_path):
    freqs = []
    for rank, stage in ((0, 0), (1, 1)):  # encoders_colocated: stage 0 (encoders) on rank 0, the LLM on rank 1
        for m in range(2):
            freqs.append(ActionFrequency(rank, action_label("F", stage, m), 1000 + 100 * rank + 10 * m))
            if m == 0:  # B of microbatch 1 left out: it runs at the plan's max frequency
                freqs.append(ActionFrequency(rank, action_label("B", stage, m), 800 + 100 * rank))
    plan = EnergyPlan("test-gpu", 1980, (FrontierPoint(1.0, 10.0, tuple(freqs)),))
    (tmp_path / "plan.json").write_text(plan.to_json())
    job = job_dict(tmp_path, "energy")
    records = demo_records("train", ("image_digit",), limit=6) + demo_records("train", ("text",), limit=2)
    job["data"]["train"] = str(write_jsonl(tmp_path / "images.jsonl", records))
    job["train"]["steps"], job["checkpoint"]["every"] = 2, 0
    job["data"]["val"], job["data"]["num_workers"] = None, 0
    job["parallel"]["pp"] = {"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b", "microbatches": 2}
    job["energy"] = {"plan": str(tmp_path / "plan.json"), "patience": 1}
    torchrun_train(job, tmp_path, "energy")
    run = tmp_path / "energy"
    assert sorted(r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r) == [1, 2]
    events = read_chrome_trace(run / "timeline.json")["measured"]
    assert len(events) == 8  # 2 ranks x (2 F + 2 B)
    for e in events:
        label = action_label(e.kind, e.stage, e.microbatch)
        assert e.frequency_mhz == plan.frequency_of(plan.points[0], e.rank, label), (e, label)
    assert {e.frequency_mhz for e in events if e.kind == "B" and e.microbatch == 1} == {1980}
