"""The tiny mixture-of-experts MLLM of the expert-parallel tests: a SigLIP vision encoder (frozen) and a linear
projector (trained) in front of a Qwen3-MoE LLM (hidden 32, 2 layers, 4 experts, top-2), on demo images and text."""

from __future__ import annotations

import dataclasses
import json

import torch

from plait.planner.cost.types import DeviceSpec
from plait.train.metrics import read_metrics
from tests.helpers.data_parallel import assert_same_training
from tests.distributed.spawning import run_main
from tests.helpers.fsdp import LIMIT_S
from tests.helpers.jobs import ROOT, demo_records, tiny_config_dict, write_jsonl
from tests.helpers.pixtral_internvl_parallel import vision_job

WORKER = ROOT / "tests" / "distributed" / "ep_worker.py"
"""The expert-parallel gloo worker (``tests/distributed/ep_worker.py``)."""

DEMO = ROOT / "configs" / "demo.toml"
MOE = ('--model.llm.config={model_type = "qwen3_moe", hidden_size = 128, intermediate_size = 384, '
       'moe_intermediate_size = 256, num_experts = 64, num_experts_per_tok = 2, num_hidden_layers = 4, '
       'num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 512, '
       'tie_word_embeddings = true}')
OVERRIDES = [MOE, "--train.global_batch_size=32"]  # 2 microbatches of 16 samples
"""The demo job with a Qwen3-MoE LLM of 64 experts (97% of the parameters), for the planner's EP tests."""
TIGHT = dataclasses.replace(DeviceSpec.h100(), memory_bytes=0.08 * 2**30)  # cap 73.7 MiB per device
"""Each LLM layer of :data:`OVERRIDES`' model holds about 100 MiB of parameters, gradients and AdamW state: 8
devices fit them only with the experts split (EP) or offloaded to the host."""


def assert_equal_runs(single: dict, other: dict) -> None:
    """Losses (rel 1e-5), gradients and final parameters of two worker results equal (``assert_same_training``)."""
    torch.testing.assert_close(torch.tensor(other["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    assert_same_training(single, other)

TINY_MOE_LLM = dict(model_type="qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=512)


def moe_records() -> list[dict]:
    """Eight demo samples: six with an image, two text-only."""
    return demo_records("train", ("image_digit",), limit=6) + demo_records("train", ("text",), limit=2)


def moe_job(tmp_path, train: dict | None = None, **parallel) -> dict:
    """2 steps of a global batch of 8 in microbatches of 2 (samples in order, each DP rank a share with an image),
    frozen encoder, a checkpoint every step; ``parallel`` sets ``[parallel]``."""
    data = write_jsonl(tmp_path / "train.jsonl", moe_records())
    cfg = tiny_config_dict(str(data), None, str(tmp_path / "run"), data={"shuffle": False},
                           train={"steps": 2, "global_batch_size": 8, "microbatch_size": 2, "threads": 1,
                                  "microbatch_policy": "arrival", **(train or {})},
                           parallel={"timeout_s": 60, **parallel}, checkpoint={"every": 1, "keep": 2})
    cfg["model"]["llm"]["config"] = dict(TINY_MOE_LLM)
    del cfg["model"]["encoders"]["audio"]
    cfg["model"]["encoders"]["vision"]["freeze"] = True
    return cfg


def with_validation(cfg: dict, tmp_path) -> dict:
    """``cfg`` validating 5 demo samples with images or text (loss and 3-token answers) after its second step."""
    records = demo_records("val", ("image_digit",), limit=3) + demo_records("val", ("text",), limit=2)
    cfg["data"]["val"] = str(write_jsonl(tmp_path / "val.jsonl", records))
    cfg["train"].update(eval_every=2, max_new_tokens=3)
    return cfg


def validation(tmp_path, name: str) -> tuple[float, list[str]]:
    """The validation loss run ``name`` wrote to its metrics and its answers (``predictions/step_2.jsonl``)."""
    run = tmp_path / f"run_{name}"
    loss = next(r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r)
    lines = (run / "predictions" / "step_2.jsonl").read_text().splitlines()
    return loss, sorted(lines)


QWEN3_VL_MOE_VISION = dict(model_type="qwen3_vl_moe_vision", depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
QWEN3_VL_MOE_LLM = dict(model_type="qwen3_vl_moe_text", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                         "mrope_interleaved": True})


def qwen3_vl_moe_job(tmp_path, run: str, **parallel) -> dict:
    """A Qwen3-VL-MoE job built from configs (trainable tower whose blocks 0 and 1 feed DeepStack features to LLM
    layers 0 and 1 of a 2-layer MoE text model: 4 experts, top-2): 2 steps of 4 samples (single images, two images of
    different sizes in one record, text only), records and run folder under ``tmp_path / "qwen3_vl_moe"``."""
    folder = tmp_path / "qwen3_vl_moe"
    folder.mkdir(exist_ok=True)
    branch = {"modality": "image", "config": dict(QWEN3_VL_MOE_VISION), "projector": "linear",
              "processor": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 30}}
    job = vision_job(folder, branch, run)
    job["model"]["llm"]["config"] = dict(QWEN3_VL_MOE_LLM)
    job["parallel"].update(parallel)
    return job


def run_jobs(jobs: list[tuple[dict, str]], tmp_path, nproc: int) -> list[dict]:
    """Train each ``(config, name)`` of ``jobs`` in turn on the same ``nproc`` processes (one spawn of the EP worker,
    run folder ``run_<name>``); what rank 0 wrote for each."""
    argv = []
    for cfg, name in jobs:
        cfg = json.loads(json.dumps(cfg))
        cfg["metrics"]["run_dir"] = str(tmp_path / f"run_{name}")
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
        argv += [str(tmp_path / f"{name}.json"), str(tmp_path / f"{name}.pt")]
    run_main(f"tests.distributed.{WORKER.stem}", argv, nproc, LIMIT_S, "+".join(name for _, name in jobs))
    return [torch.load(tmp_path / f"{name}.pt") for _, name in jobs]
