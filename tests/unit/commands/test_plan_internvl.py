"""``plait plan`` of an InternVL branch: its ``downsample`` is a pixel shuffle (d x d patches -> one feature d^2
wide), not pooling, so the projector the plan costs is the live model's (input width H d^2) and the features per
tile shrink by d^2 (it costed a projector of width H over 1 / d of the tokens)."""

from __future__ import annotations

from plait.models.plan_inputs import build_plan_inputs
from plait.config.loader import config_from_dict
from plait.models.registry import build_model, load_tokenizer
from tests.helpers.jobs import tiny_config_dict, write_jsonl
from tests.helpers.pixtral_internvl import TINY_INTERNVL


def test_plan_costs_internvl_projector_and_features_as_the_live_model(tmp_path):
    records = [{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}]}]
    cfg = tiny_config_dict(str(write_jsonl(tmp_path / "train.jsonl", records)), None, str(tmp_path / "run"))
    cfg["model"]["encoders"] = {"vision": {"modality": "image", "config": dict(TINY_INTERNVL), "select": "drop_cls",
                                           "downsample": 2, "processor": {"max_patches": 6}}}
    job = config_from_dict(cfg)
    inputs = build_plan_inputs(job, "cpu")
    assert inputs.model_configs["vision"].output_pool == 4  # 2 x 2 patches per feature
    model = build_model(job.model, load_tokenizer(job.data.tokenizer))
    live = sum(p.numel() for p in model.encoders["vision"].projector.parameters())
    names = [u.name for u in inputs.units]
    costed = inputs.costs[names.index("encoders.vision.projector")]
    width = {"float32": 4, "bfloat16": 2}[inputs.dtype]
    assert costed.param_bytes == live * width
