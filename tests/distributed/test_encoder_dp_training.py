"""``plait train`` with ``parallel.pp.encoder_dp`` (the vision branch replicated inside each pipeline) equals one
process on the tiny job (fp32; step losses within rtol 1e-5, final parameters within rtol 1e-4 / atol 1e-5), on 4
gloo ranks started with torchrun's variables:

- everything trainable, vision on 2 replica ranks of its own beside audio's rank, feeding the LLM's rank (PP 4);
  its step-1 checkpoint resumed in one process (another layout: no pipeline) continues as the uninterrupted run;
- frozen towers, trainable projectors and LoRA on the LLM, vision's 2 replicas on the 2 LLM ranks
  (``encoders_in_bubble``) of PP 2 x DP 2.
"""

from __future__ import annotations

import torch

from plait.config.loader import config_from_dict
from plait.models.multimodal import MultimodalModel
from plait.train.plots import read_chrome_trace
from plait.train.trainer import Trainer
from tests.helpers.pipeline_training import assert_run_equals, job_dict, losses_of, torchrun_train


def _job(tmp_path, run: str, lora: bool) -> dict:
    job = job_dict(tmp_path, run)
    job["data"]["val"] = None
    if lora:
        job["model"]["llm"]["lora"] = {"r": 4, "alpha": 8.0}
        for name in ("vision", "audio"):
            job["model"]["encoders"][name]["freeze"] = True
    return job


def _reference(tmp_path, name: str, lora: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    single = Trainer.build(config_from_dict(_job(tmp_path, name, lora)))
    out = single.fit()
    return out, {n: p.detach().clone() for n, p in single.model.named_parameters() if not n.endswith("k_proj.bias")}


def test_encoder_dp_trains_like_one_process_and_resumes_in_another_layout(tmp_path):
    ref, ref_params = _reference(tmp_path, "single", lora=False)
    job = _job(tmp_path, "own", lora=False)
    job["parallel"]["pp"] = {"degree": 4, "encoder_dp": {"vision": 2}}
    proc = torchrun_train(job, tmp_path, "own", nproc=4)
    assert "encoder_dp" not in proc.stderr
    losses = losses_of(tmp_path / "own")
    assert sorted(losses) == [1, 2, 3]
    events = read_chrome_trace(tmp_path / "own" / "timeline.json")["measured"]
    # vision's replica stages 0 and 1 on ranks 0 and 1, audio's stage 2 on rank 2, the LLM's stage 3 on rank 3
    assert {(e.stage, e.rank) for e in events if e.kind == "F"} == {(0, 0), (1, 1), (2, 2), (3, 3)}
    final = dict(MultimodalModel.from_pretrained(tmp_path / "own" / "final", "eager").named_parameters())
    assert_run_equals(tmp_path / "own", ref["losses"], {n: final[n] for n in final if n.endswith("k_proj.bias")}
                      | ref_params, steps=(1, 2, 3))

    # resume the replicated run's step-1 checkpoint without any pipeline: steps 2 and 3 as uninterrupted
    resumed = Trainer.build(config_from_dict(_job(tmp_path, "resumed", lora=False)))
    out = resumed.fit(resume=str(tmp_path / "own" / "checkpoints" / "step_000001"))
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"][1:]), rtol=1e-5, atol=0)


def test_encoder_dp_in_the_bubbles_with_lora_trains_like_one_process(tmp_path):
    ref, ref_params = _reference(tmp_path, "single", lora=True)
    job = _job(tmp_path, "bubble", lora=True)
    job["parallel"]["pp"] = {"degree": 2, "encoders_in_bubble": True, "encoder_dp": {"vision": 2}}
    torchrun_train(job, tmp_path, "bubble", nproc=4)
    final = dict(MultimodalModel.from_pretrained(tmp_path / "bubble" / "final", "eager").named_parameters())
    assert any(".lora_" in n for n in final)
    assert_run_equals(tmp_path / "bubble", ref["losses"], {n: final[n] for n in final if n.endswith("k_proj.bias")}
                      | ref_params, steps=(1, 2, 3))
