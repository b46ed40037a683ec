"""The encoder families of issue 18 under PP=2 (both layouts) and CP=2 (gloo, ``plait train`` under torchrun)
equal one process: per-step losses and the final model.

Parametrised over the families (a tiny encoder config each, one audio-only or image-only job); every encoder
branch is one pipeline stage (Qwen2-Audio's padding mask and pooler live inside its own forward, so its layers
are never split from its embedding), the LLM the other.
"""

from __future__ import annotations

import pytest
import torch

from plait.config.loader import config_from_dict
from plait.models.multimodal import MultimodalModel
from plait.train.trainer import Trainer
from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl
from tests.helpers.pipeline_training import losses_of, torchrun_train
from tests.helpers.qwen2_audio import TINY_QWEN2_AUDIO
from tests.helpers.siglip2 import TINY_SIGLIP2

FAMILIES = {
    "qwen2_audio": ("audio_transcribe", {"modality": "audio", "config": dict(TINY_QWEN2_AUDIO), "projector": "linear"}),
    "siglip2": ("image_digit", {"modality": "image", "config": dict(TINY_SIGLIP2)}),
}
LAYOUTS = {
    "pp2-encoder_parallel": {"pp": {"degree": 2, "layout": "encoder_parallel", "schedule": "1f1b"}},
    "pp2-encoders_colocated": {"pp": {"degree": 2, "layout": "encoders_colocated", "schedule": "gpipe"}},
    "cp2": {"cp": 2},
}


def _job(tmp_path, family: str, run: str) -> dict:
    task, branch = FAMILIES[family]
    records = demo_records("train", (task,), limit=3) + demo_records("train", ("text",), limit=1)
    data = write_jsonl(tmp_path / "train.jsonl", records)
    job = tiny_config_dict(str(data), None, str(tmp_path / run), data={"shuffle": False},
                           train={"steps": 2, "global_batch_size": 4, "microbatch_size": 2, "threads": 1},
                           attention={"block_size": 16}, parallel={"timeout_s": 60})
    job["model"]["encoders"] = {branch["modality"]: dict(branch)}
    return job


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Single-process losses and final parameters per family (computed once)."""
    out = {}
    for family in FAMILIES:
        tmp = tmp_path_factory.mktemp(family)
        trainer = Trainer.build(config_from_dict(_job(tmp, family, "single")))
        result = trainer.fit()
        out[family] = (result["losses"], {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_new_encoder_under_pp_and_cp_equals_one_process(tmp_path, references, family, layout):
    ref_losses, ref_params = references[family]
    job = _job(tmp_path, family, layout)
    job["parallel"].update(LAYOUTS[layout])
    torchrun_train(job, tmp_path, layout)
    losses = losses_of(tmp_path / layout)
    torch.testing.assert_close(torch.tensor([losses[s] for s in (1, 2)]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    final = dict(MultimodalModel.from_pretrained(tmp_path / layout / "final", "eager").named_parameters())
    assert set(final) == set(ref_params)
    for name, value in ref_params.items():
        if not name.endswith("k_proj.bias"):  # zero gradient in exact arithmetic: AdamW amplifies rounding noise
            torch.testing.assert_close(final[name], value, rtol=1e-4, atol=1e-5, msg=name)
