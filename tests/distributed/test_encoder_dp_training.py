"""``plait train`` with ``parallel.pp.encoder_dp`` (an encoder branch replicated inside each pipeline) and
``encoder_tp`` (a branch split by tensor parallelism over ranks of its own) equals one process on the tiny job (fp32;
step losses within rtol 1e-5, final parameters within rtol 1e-4 / atol 1e-5), on 5 and 4 gloo ranks started with
torchrun's variables:

- ``encoder_dp`` and ``encoder_tp`` in one pipeline (PP 5): vision split by tensor parallelism over 2 ranks of its
  own (``encoder_tp``) with LoRA adapters on its tower's linear layers (their base layers and adapters split by the
  TP plan), audio on 2 replica ranks of its own (``encoder_dp``), everything else trainable, feeding the LLM's rank;
  validation runs through the pipeline and equals one process's; its step-1 checkpoint (TP shards, replicas)
  resumed in one process (another layout: no pipeline) continues as the uninterrupted run;
- frozen towers, trainable projectors and LoRA on the LLM, vision's 2 replicas on the 2 LLM ranks
  (``encoders_in_bubble``) of PP 2 x DP 2.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import FileSystemReader

from plait.config.loader import config_from_dict
from plait.models.multimodal import MultimodalModel
from plait.train.metrics import read_metrics
from plait.train.plots import read_chrome_trace
from plait.train.trainer import Trainer
from tests.helpers.pipeline_training import assert_run_equals, job_dict, losses_of, torchrun_train


def _job(tmp_path, run: str, lora: bool, vision_lora: bool = False) -> dict:
    job = job_dict(tmp_path, run)
    if vision_lora:  # validation stays on (3 samples, the third an image): it runs through the TP pipeline
        job["model"]["encoders"]["vision"]["lora"] = {"r": 4, "alpha": 8.0}
        job["data"]["val_max_samples"] = 3
    else:
        job["data"]["val"] = None
    if lora:
        job["model"]["llm"]["lora"] = {"r": 4, "alpha": 8.0}
        for name in ("vision", "audio"):
            job["model"]["encoders"][name]["freeze"] = True
    return job


def _reference(tmp_path, name: str, lora: bool, vision_lora: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    single = Trainer.build(config_from_dict(_job(tmp_path, name, lora, vision_lora)))
    out = single.fit()
    return out, {n: p.detach().clone() for n, p in single.model.named_parameters() if not n.endswith("k_proj.bias")}


def test_encoder_dp_and_tp_train_like_one_process_and_resume_in_another_layout(tmp_path):
    ref, ref_params = _reference(tmp_path, "single", lora=False, vision_lora=True)
    job = _job(tmp_path, "own", lora=False, vision_lora=True)
    job["parallel"]["pp"] = {"degree": 5, "encoder_tp": {"vision": 2}, "encoder_dp": {"audio": 2}}
    proc = torchrun_train(job, tmp_path, "own", nproc=5)
    assert "encoder_dp" not in proc.stderr and "encoder_tp" not in proc.stderr
    losses = losses_of(tmp_path / "own")
    assert sorted(losses) == [1, 2, 3]
    events = read_chrome_trace(tmp_path / "own" / "timeline.json")["measured"]
    # vision's TP stages 0 and 1 on ranks 0 and 1, audio's replica stages 2 and 3 on ranks 2 and 3, the LLM's stage
    # 4 on rank 4
    assert {(e.stage, e.rank) for e in events if e.kind == "F"} == {(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)}
    evals = [r["eval"] for r in read_metrics(tmp_path / "own" / "metrics.jsonl") if "eval" in r]
    assert evals == [ref["eval"]] and "validation exact match" in proc.stdout
    assert set(ref["eval"]) == {"audio_transcribe", "image_digit"}  # an image through the TP tower too
    final = dict(MultimodalModel.from_pretrained(tmp_path / "own" / "final", "eager").named_parameters())
    assert any(n.startswith("encoders.vision.") and ".lora_" in n for n in final)
    assert_run_equals(tmp_path / "own", ref["losses"], {n: final[n] for n in final if n.endswith("k_proj.bias")}
                      | ref_params, steps=(1, 2, 3))

    # the TP plan split the LoRA-wrapped layers: a colwise base and its lora_B, a rowwise base and its lora_A are
    # saved as one shard per TP rank (rows / columns), the other adapter whole
    step1 = tmp_path / "own" / "checkpoints" / "step_000001"
    saved = FileSystemReader(str(step1)).read_metadata().state_dict_metadata
    attn = "model.encoders.vision.encoder.encoder.layers.0.self_attn."
    shards = {n: [tuple(c.sizes) for c in saved[attn + n + ".weight"].chunks]
              for n in ("q_proj.base_layer", "q_proj.lora_B.default", "q_proj.lora_A.default",
                        "out_proj.base_layer", "out_proj.lora_A.default", "out_proj.lora_B.default")}
    assert shards == {"q_proj.base_layer": [(16, 32)] * 2, "q_proj.lora_B.default": [(16, 4)] * 2,
                      "q_proj.lora_A.default": [(4, 32)], "out_proj.base_layer": [(32, 16)] * 2,
                      "out_proj.lora_A.default": [(4, 16)] * 2, "out_proj.lora_B.default": [(32, 4)]}

    # resume the TP + replicated run's step-1 checkpoint without any pipeline: steps 2 and 3 as uninterrupted
    resumed_job = _job(tmp_path, "resumed", lora=False, vision_lora=True)
    resumed_job["data"]["val"] = None
    resumed = Trainer.build(config_from_dict(resumed_job))
    out = resumed.fit(resume=str(step1))
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"][1:]), rtol=1e-5, atol=0)
    for name, value in resumed.model.named_parameters():
        if name in ref_params:
            torch.testing.assert_close(value, ref_params[name], rtol=1e-4, atol=1e-5, msg=name)


def test_encoder_dp_in_the_bubbles_with_lora_trains_like_one_process(tmp_path):
    ref, ref_params = _reference(tmp_path, "single", lora=True)
    job = _job(tmp_path, "bubble", lora=True)
    job["parallel"]["pp"] = {"degree": 2, "encoders_in_bubble": True, "encoder_dp": {"vision": 2}}
    torchrun_train(job, tmp_path, "bubble", nproc=4)
    final = dict(MultimodalModel.from_pretrained(tmp_path / "bubble" / "final", "eager").named_parameters())
    assert any(".lora_" in n for n in final)
    assert_run_equals(tmp_path / "bubble", ref["losses"], {n: final[n] for n in final if n.endswith("k_proj.bias")}
                      | ref_params, steps=(1, 2, 3))
