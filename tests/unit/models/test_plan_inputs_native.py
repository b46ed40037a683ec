"""The planner sizes an item of a native-resolution tower (a patch merger after it: Qwen3-VL here) as the largest
image its job's processor keeps (``max_pixels`` or ``size.longest_edge``), not as one attention window."""

from __future__ import annotations

import pytest

from plait.commands.import_hf import import_checkpoint
from plait.config.loader import load_config
from plait.models.plan_inputs import max_pixels, model_parts
from tests.helpers.qwen3_vl import save_qwen3_vl


def test_max_pixels_sizes_a_native_resolution_item(tmp_path):
    _, job = import_checkpoint(save_qwen3_vl(tmp_path / "qwen3-vl"), tmp_path / "imported")
    default, _, _ = model_parts(load_config(job))
    patch = default["vision"].patch[1]
    assert patch == 4 and default["vision"].item_len == 16  # one 2x2 merge of 2x2 blocks: no size was given
    for table in ("--model.encoders.vision.processor={max_pixels = 4096}",
                  "--model.encoders.vision.processor={size = {longest_edge = 4096, shortest_edge = 64}}"):
        sized, _, _ = model_parts(load_config(job, [table]))
        assert sized["vision"].item_len == 4096 // patch**2 == 256


def test_max_pixels_reads_both_names_and_refuses_bad_values():
    assert max_pixels({}) == 0 and max_pixels({"max_pixels": 1003520}) == 1003520
    assert max_pixels({"size": {"longest_edge": 12845056}}) == 12845056
    for bad in (0, -5, 1.5, "big", True):
        with pytest.raises(ValueError, match=r"^processor\.max_pixels must be a positive integer"):
            max_pixels({"max_pixels": bad})


def test_a_pretrained_branch_without_a_table_is_planned(tmp_path):
    """A ``model.pretrained`` job that names no ``[model.encoders.<name>]`` table plans the model's branches as it
    trains them (the defaults), not 'no config for module'."""
    model_dir, job = import_checkpoint(save_qwen3_vl(tmp_path / "qwen3-vl"), tmp_path / "imported")
    bare = tmp_path / "bare.toml"
    bare.write_text(f'[model]\npretrained = "{model_dir}"\n\n[data]\ntrain = "{tmp_path / "train.jsonl"}"\n')
    with_table, _, _ = model_parts(load_config(job))
    without, frozen, _ = model_parts(load_config(bare))
    assert set(without) == set(with_table) == {"vision", "vision.projector", "llm"}
    assert without["vision"] == with_table["vision"] and frozen["vision"] is False  # the schema's default
