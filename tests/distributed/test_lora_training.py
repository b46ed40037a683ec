"""LoRA training (issue 15): DP=2 and PP=2 (gloo, torchrun) equal one process, only adapters and projectors train,
base weights stay bit-identical, ``final/`` holds each part's adapter in peft's format, and a resume with another
layout continues exactly.

The job is the pipeline-training test's (tests/distributed/test_pipeline_training.py: 8 samples of every
modality, batch 4 in microbatches of 2, AdamW) with LoRA on the LLM (r 4), the vision encoder (r 2) and the audio
encoder (r 2), projectors trainable. Tolerances as that test: losses rel 1e-5, final adapters rtol 1e-4 /
atol 1e-5 (another layout sums gradients in another order).
"""

from __future__ import annotations

import peft
import torch
from transformers import AutoModelForCausalLM

from plait.config.loader import config_from_dict
from plait.models.multimodal import MultimodalModel
from plait.train.trainer import Trainer
from tests.distributed.test_pipeline_training import job_dict, losses_of, torchrun_train


def lora_job(tmp_path, run: str) -> dict:
    job = job_dict(tmp_path, run)
    job["model"]["llm"]["lora"] = {"r": 4, "alpha": 8.0}
    for name in ("vision", "audio"):
        job["model"]["encoders"][name]["lora"] = {"r": 2, "alpha": 4.0}
    job["data"]["val"] = None
    return job


def _assert_final(final: MultimodalModel, ref: MultimodalModel, initial: dict[str, torch.Tensor]) -> None:
    """Adapters and projectors of ``final`` equal the reference's (and moved); every other tensor equals its
    initial value bit for bit."""
    ref_params = dict(ref.named_parameters())
    moved = 0
    for name, param in final.named_parameters():
        if ".lora_" in name or ".projector." in name:
            torch.testing.assert_close(param, ref_params[name], rtol=1e-4, atol=1e-5, msg=name)
            moved += int(not torch.equal(param, initial[name]))
        else:
            assert torch.equal(param, initial[name]), name
    assert moved > 0.5 * sum(".lora_" in n or ".projector." in n for n in ref_params)


def test_lora_trains_alike_in_every_layout_and_exports_peft_adapters(tmp_path):
    single = Trainer.build(config_from_dict(lora_job(tmp_path, "single")))
    initial = {n: p.detach().clone() for n, p in single.model.named_parameters()}
    in_optimizer = {id(p) for g in single.optimizer.param_groups for p in g["params"]}
    trained = {n for n, p in single.model.named_parameters() if id(p) in in_optimizer}
    assert trained and all(".lora_" in n or ".projector." in n for n in trained)
    assert {n for n in initial if ".lora_" in n} <= trained
    ref = single.fit()
    _assert_final(single.model, single.model, initial)

    for name, parallel in [("dp", {"dp": 2}), ("pp", {"pp": {"degree": 2, "layout": "encoders_colocated",
                                                              "schedule": "1f1b"}})]:
        job = lora_job(tmp_path, name)
        job["parallel"].update(parallel)
        torchrun_train(job, tmp_path, name)
        losses = losses_of(tmp_path / name)
        torch.testing.assert_close(torch.tensor([losses[s] for s in sorted(losses)]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=0, msg=name)
        final_dir = tmp_path / name / "final"
        _assert_final(MultimodalModel.from_pretrained(final_dir), single.model, initial)

    # the LLM's adapter, loaded with plain peft onto the plain Hugging Face LLM, gives the composite's logits
    llm_dir = tmp_path / "pp" / "final" / "llm"
    plain = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llm_dir), llm_dir / "adapter")
    ids = torch.randint(0, 300, (2, 11))
    torch.testing.assert_close(plain(input_ids=ids).logits, single.model.language_model(input_ids=ids).logits,
                               rtol=0, atol=1e-5)

    # resume the PP run's step-1 checkpoint in one process: steps 2 and 3 as the uninterrupted run
    job = lora_job(tmp_path, "resumed")
    resumed = Trainer.build(config_from_dict(job))
    out = resumed.fit(resume=str(tmp_path / "pp" / "checkpoints" / "step_000001"))
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"][1:]), rtol=1e-5, atol=0)
    _assert_final(resumed.model, single.model, initial)
