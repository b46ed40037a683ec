"""Expert parallelism (``parallel.ep``) under torchrun (gloo) equals one process on the same global batches: the
tiny MoE MLLM (frozen SigLIP encoder, trained projector, Qwen3-MoE LLM with 4 experts, top-2), losses (rel 1e-5),
first-step gradients (rel 1e-5 of each gradient's scale) and final parameters after 2 AdamW steps (rtol 1e-5 /
atol 1e-6; ``assert_same_training``): EP=2 over 2 DP ranks and over 4 (each expert shard on 2 ranks), with every
token routed to the first EP rank's experts (the second receives zero-size all-to-all splits), EP=2 x PP=2 on 4
processes and EP=2 x FSDP2 (``dp_shard = 2``, the same 2 ranks) with their validation (every expert gathered),
LoRA on the LLM's attention with the experts frozen,
and resuming across EP degrees (DCP reshards the expert DTensors). A Qwen3-VL-MoE job (Qwen3-VL tower, trained, whose
DeepStack features reach the first layers of a MoE text model with 4 experts, top-2) at EP=2 equals one process too,
trained in the same processes after the first job."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.fsdp import assert_same_params, run
from tests.helpers.moe import (WORKER, assert_equal_runs, moe_job, qwen3_vl_moe_job, run_jobs, validation,
                               with_validation)

EXPERTS = "language_model.model.layers.0.mlp.experts.gate_up_proj"
VL_TOWER = "encoders.vision.encoder.deepstack_merger_list.1.linear_fc2.weight"


def test_ep2_equals_one_process_frozen_encoder_and_no_local_expert(tmp_path):
    # with a Qwen3-VL-MoE job (DeepStack, trainable tower) trained after the first in the same processes
    single, vl_single = run_jobs([(moe_job(tmp_path), "single"), (qwen3_vl_moe_job(tmp_path, "vl"), "vl_single")],
                                 tmp_path, 1)
    ep, vl_ep = run_jobs([(moe_job(tmp_path, ep=2), "ep"), (qwen3_vl_moe_job(tmp_path, "vl", ep=2), "vl_ep")],
                         tmp_path, 2)
    assert single["local"][0] == [(4, 32, 32)] * 2 and ep["local"] == [[(2, 32, 32)] * 2] * 2  # E/ep experts each
    assert vl_ep["local"] == [[(2, 32, 32)] * 2] * 2 and VL_TOWER in vl_single["grads"]
    assert_equal_runs(vl_single, vl_ep)
    assert EXPERTS in single["grads"] and not any(n.startswith("encoders.vision.encoder.") for n in single["grads"])
    assert_equal_runs(single, ep)
    # resume across EP degrees: step 1 of the EP=2 run in one process, step 1 of the one-process run at EP=2; and
    # every token to experts 0, 1 (the first EP rank's): the second joins the all-to-alls with zero rows, no hang
    # (each pair trained in turn in the same processes: one spawn per process count)
    step1 = "checkpoints/step_000001"
    to_one, folded = run_jobs([(moe_job(tmp_path) | {"resume_from": str(tmp_path / "run_ep" / step1)}, "to_one"),
                               (moe_job(tmp_path) | {"experts_of_rank0": True}, "folded")], tmp_path, 1)
    to_ep, ep_folded = run_jobs([(moe_job(tmp_path, ep=2) | {"resume_from": str(tmp_path / "run_single" / step1)},
                                  "to_ep"), (moe_job(tmp_path, ep=2) | {"experts_of_rank0": True}, "ep_folded")],
                                tmp_path, 2)
    for resumed in (to_one, to_ep):
        assert resumed["start"] == 1
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(single["losses"][1:]), rtol=1e-5,
                                   atol=0)
        assert_same_params(single, resumed)
    assert float(folded["grads"][EXPERTS][2:].abs().max()) == 0.0 < float(folded["grads"][EXPERTS][:2].abs().max())
    assert_equal_runs(folded, ep_folded)


def test_ep2_with_pp2_and_with_fsdp2_equal_one_process_validation_included(tmp_path):
    """Validation (loss and answers) after step 2 with every expert gathered on every rank, equal too."""
    single = run(with_validation(moe_job(tmp_path), tmp_path), tmp_path, "single", 1, WORKER)
    pp = {"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b", "attach_encoders": True,
          "stages": {"vision": 1, "llm": 2}, "splits": {"llm": ["language_model.model.layers.1"]}}  # a layer each
    # dp = 4, ep = 2 (two EP groups, each expert shard summed over its 2 replicas: ranks 0, 2 and 1, 3) trained
    # after EP x PP in the same 4 processes
    ep_pp, replicas = run_jobs([(with_validation(moe_job(tmp_path, ep=2, pp=pp), tmp_path), "ep_pp"),
                                (moe_job(tmp_path, ep=2), "ep_replicas")], tmp_path, 4)
    assert ep_pp["world"] == 4 and all(len(x) == 1 and x[0][0] == 2 for x in ep_pp["local"])  # a layer per stage
    assert_equal_runs(single, ep_pp)
    ep_fsdp = run(with_validation(moe_job(tmp_path, ep=2, dp_shard=2), tmp_path), tmp_path, "ep_fsdp", 2, WORKER)
    assert ep_fsdp["sharded"] and ep_fsdp["local"] == [[(2, 32, 32)] * 2] * 2  # experts by EP, the rest by FSDP2
    assert_equal_runs(single, ep_fsdp)
    loss, answers = validation(tmp_path, "single")
    for name in ("ep_pp", "ep_fsdp"):
        got_loss, got_answers = validation(tmp_path, name)
        assert got_loss == pytest.approx(loss, rel=1e-5) and got_answers == answers and len(answers) == 5
    assert replicas["local"] == [[(2, 32, 32)] * 2] * 4
    assert_equal_runs(single, replicas)


def test_ep2_with_lora_on_attention_and_frozen_experts(tmp_path):
    cfg = moe_job(tmp_path, ep=2)
    cfg["model"]["llm"]["lora"] = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    one = json.loads(json.dumps(cfg))
    one["parallel"]["ep"] = 1
    single = run(one, tmp_path, "single", 1, WORKER)
    ep = run(cfg, tmp_path, "ep", 2, WORKER)
    llm = [n for n in single["trained"] if n.startswith("language_model.")]
    assert llm and all(".lora_" in n for n in llm)  # experts and router frozen: their all-to-alls carry the adapters'
    assert ep["local"] == [[(2, 32, 32)] * 2] * 2  # gradients back to the attention of every layer
    torch.testing.assert_close(torch.tensor(ep["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    assert set(ep["grads"]) == set(single["grads"])
    for name, grad in single["grads"].items():  # lora_A's first gradient is exactly 0 (lora_B starts at 0)
        tol = 1e-5 * float(grad.abs().max()) + 1e-9
        torch.testing.assert_close(ep["grads"][name], grad, rtol=1e-5, atol=tol, msg=name)
        torch.testing.assert_close(ep["params"][name], single["params"][name], rtol=1e-4, atol=1e-5, msg=name)
