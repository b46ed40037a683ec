"""LoRA training (issue 15): DP=2 and PP=2 (gloo, torchrun) equal one process, only adapters and projectors train,
base weights stay bit-identical, ``final/`` holds each part's adapter in peft's format (or, with
``checkpoint.merge_lora``, plain parts with the adapters merged), and a resume with another layout continues exactly;
interleaved PP with deferral and CP = 2 compare first-step adapter gradients too.

The job is the pipeline-training test's (tests/distributed/test_pipeline_training.py: 8 samples of every
modality, batch 4 in microbatches of 2, AdamW) with LoRA on the LLM (r 4), the vision encoder (r 2) and the audio
encoder (r 2), projectors trainable. Tolerances as that test: losses rel 1e-5, final adapters rtol 1e-4 /
atol 1e-5 (another layout sums gradients in another order).
"""

from __future__ import annotations

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from plait.config.loader import config_from_dict
from plait.models.multimodal import MultimodalModel
from plait.train.trainer import Trainer
from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl
from tests.helpers.data_parallel import run
from tests.helpers.pipeline_deferral import deferral_train
from tests.helpers.pipeline_training import job_dict, losses_of, torchrun_train
from tests.helpers.deferral import deferral_records


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

    ids = torch.randint(0, 300, (2, 11))
    for name, parallel in [("dp", {"dp": 2}), ("pp", {"pp": {"degree": 2, "layout": "encoders_colocated",
                                                              "schedule": "1f1b"}})]:
        job = lora_job(tmp_path, name)
        job["parallel"].update(parallel)
        job["checkpoint"]["merge_lora"] = name == "dp"  # the DP run exports merged adapters
        torchrun_train(job, tmp_path, name)
        losses = losses_of(tmp_path / name)
        torch.testing.assert_close(torch.tensor([losses[s] for s in sorted(losses)]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=0, msg=name)
        final = MultimodalModel.from_pretrained(tmp_path / name / "final")
        if name == "pp":
            _assert_final(final, single.model, initial)
        else:  # merged: plain Hugging Face parts, no adapter folder, the adapted model's logits
            assert not (tmp_path / name / "final" / "llm" / "adapter").exists()
            assert not any(".lora_" in n for n, _ in final.named_parameters())
            torch.testing.assert_close(final.language_model(input_ids=ids).logits,
                                       single.model.language_model(input_ids=ids).logits, rtol=0, atol=1e-5)

    # the LLM's adapter, loaded with plain peft onto the plain Hugging Face LLM, gives the composite's logits
    llm_dir = tmp_path / "pp" / "final" / "llm"
    plain = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llm_dir), llm_dir / "adapter")
    torch.testing.assert_close(plain(input_ids=ids).logits, single.model.language_model(input_ids=ids).logits,
                               rtol=0, atol=1e-5)

    # resume the PP run's step-1 checkpoint in one process: steps 2 and 3 as the uninterrupted run
    job = lora_job(tmp_path, "resumed")
    resumed = Trainer.build(config_from_dict(job))
    out = resumed.fit(resume=str(tmp_path / "pp" / "checkpoints" / "step_000001"))
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"][1:]), rtol=1e-5, atol=0)
    _assert_final(resumed.model, single.model, initial)


def assert_same_lora_training(ref: dict, other: dict) -> None:
    """Equal losses (rel 1e-5), first-step gradients of every trained tensor (adapters and projectors only; rtol
    1e-5 + atol 1e-5 x the tensor's largest entry, as tests/distributed/test_data_parallel.py) and every trained
    tensor after the last step (rtol 1e-5, atol 1e-6). Unlike the full-model helpers, every trained tensor's final
    value is compared: the ``A`` matrices' first-step gradient is exactly zero (``B`` starts at zero), and they move
    from step 2 on."""
    assert other["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert set(other["grads"]) == set(ref["grads"])
    assert all(".lora_" in n or ".projector." in n for n in ref["grads"])
    assert sum(".lora_B." in n and float(g.abs().max()) > 0 for n, g in ref["grads"].items()) > 10
    for name, grad in ref["grads"].items():
        tol = 1e-5 * float(grad.abs().max()) + 1e-9
        torch.testing.assert_close(other["grads"][name], grad, rtol=1e-5, atol=tol, msg=name)
        torch.testing.assert_close(other["params"][name], ref["params"][name], rtol=1e-5, atol=1e-6, msg=name)


def with_lora(cfg: dict) -> dict:
    """``cfg`` with LoRA on the LLM (r 4) and both encoders (r 2); projectors stay trainable."""
    cfg["model"]["llm"]["lora"] = {"r": 4, "alpha": 8.0}
    for enc in cfg["model"]["encoders"].values():
        enc["lora"] = {"r": 2, "alpha": 4.0}
    return cfg


PP_CASES = {
    "interleaved": ({"degree": 2, "virtual_stages": 2, "attach_encoders": True, "schedule": "interleaved_1f1b"}, 2),
    "encoder_parallel": ({"degree": 3, "layout": "encoder_parallel", "schedule": "1f1b"}, 3),
    "zero_bubble": ({"degree": 3, "layout": "encoder_parallel", "schedule": "zb_h1"}, 3),  # split backward, routed
    # ZB-V: the LLM's 4 stages in a V on 2 ranks (rank 0 holds the first and the last), encoders attached to rank 0
    "zero_bubble_v": ({"degree": 2, "virtual_stages": 2, "attach_encoders": True, "schedule": "zb_v"}, 2),
}


@pytest.mark.parametrize("case", list(PP_CASES))
def test_lora_gradients_equal_one_process_under_pp_with_deferral(tmp_path, case):
    """Interleaved 1F1B (LLM in 4 stages on 2 ranks, encoders attached to rank 0) and encoder_parallel 1F1B (vision,
    audio and the LLM on 3 ranks), the hierarchical plan deferring samples: first global batch's adapter gradients,
    both steps' losses, final adapters (:func:`assert_same_lora_training`)."""
    data = write_jsonl(tmp_path / "train.jsonl", deferral_records())
    cfg = with_lora(tiny_config_dict(str(data), None, str(tmp_path / "run"), data={"shuffle": False},
                                     train={"steps": 2, "global_batch_size": 8, "microbatch_size": 2, "threads": 1},
                                     parallel={"timeout_s": 60}))
    single = deferral_train(cfg, tmp_path, "single", 1)
    assert single["grads"] and all(".lora_" in n or ".projector." in n for n in single["grads"])
    cfg["parallel"]["pp"], nproc = PP_CASES[case]
    pp = deferral_train(cfg, tmp_path, "pp", nproc)
    assert_same_lora_training(single, pp)
    assert pp["deferred"] == single["deferred"] and pp["deferred"]


@pytest.mark.parametrize("axis", ["cp", "dp"])
def test_lora_cp2_and_dp2_equal_one_process(tmp_path, axis):
    """CP = 2 and DP = 2 (bidirectional item masks, small attention blocks): losses, first-step adapter gradients,
    final adapters."""
    records = (demo_records("train", ("image_audio",), limit=2) + demo_records("train", ("image_digit",), limit=1)
               + demo_records("train", ("text",), limit=1))
    data = write_jsonl(tmp_path / "train.jsonl", records)
    cfg = with_lora(tiny_config_dict(str(data), None, str(tmp_path / "run"), data={"shuffle": False},
                                     train={"steps": 2, "global_batch_size": 4, "microbatch_size": 2, "threads": 1},
                                     attention={"mask": "bidirectional_items", "block_size": 16},
                                     parallel={"timeout_s": 60}))
    single = run(cfg, tmp_path, "single", 1)
    cfg["parallel"][axis] = 2
    cfg["metrics"]["run_dir"] = str(tmp_path / f"run_{axis}")
    multi = run(cfg, tmp_path, axis, 2)
    assert multi["world"] == 2
    torch.testing.assert_close(torch.tensor(multi["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    assert_same_lora_training(single, multi)
