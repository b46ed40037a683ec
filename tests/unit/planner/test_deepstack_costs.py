"""DeepStack in the planner: a DeepStack tower is one stage (``Unit.joined``: plan_pipeline refuses a cut inside it,
the layout search never makes one); the unit graph's feature edges (``plait.planner.pipeline.graph.feature_receivers``: an
encoder's features enter the LLM's embedding and its first ``k`` layer units; ``carried_features``: what a stage
boundary after each LLM unit carries on) and the analytic cost model's bytes (``k`` mergers in the post-norm slot,
``(1 + k)`` features out of the projector, ``v H b`` bytes per receiving layer after a unit on the boundary, kept
per in-flight microbatch by each receiving layer), on a Qwen3-VL-shaped model described by configs."""

from __future__ import annotations

import dataclasses

import pytest

from plait.planner.cost.analytic import unit_costs, unit_estimates
from plait.planner.cost.arch import EncoderArch, units_from_configs
from plait.planner.cost.types import DeviceSpec, MicrobatchShape
from plait.planner.pipeline.graph import carried_features, feature_receivers
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.simulator import boundary_bytes_from_units
from plait.planner.search.parallel import plan_parallel
from plait.planner.search.types import SearchSpace

H, MERGE_IN = 64, 4 * 32
VISION = EncoderArch(modality="vision", hidden=32, layers=2, heads=2, head_dim=16, intermediate=64,
                     patch=(28, 14), output_pool=4, item_len=16, merger=(MERGE_IN, H), deepstack=2)
AUDIO = {"num_mel_bins": 8, "d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
         "max_source_positions": 50}
LLM = {"model_type": "qwen3", "hidden_size": H, "intermediate_size": 128, "num_hidden_layers": 4,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100}
SHAPES = {"vision": MicrobatchShape(400), "audio": MicrobatchShape(50), "llm": MicrobatchShape(300)}
VISUAL = 400 // 4  # features (visual tokens) of the vision branch in the microbatch


def _configs(deepstack: int = 2) -> dict:
    return {"vision": dataclasses.replace(VISION, deepstack=deepstack), "audio": AUDIO, "llm": LLM}


def test_the_unit_graph_says_which_llm_units_receive_which_encoders_features():
    units = units_from_configs(_configs())
    receivers = feature_receivers(units, {"vision": 2})
    assert receivers == {"vision": ("llm.embed_tokens", "llm.layers.0", "llm.layers.1"), "audio": ("llm.embed_tokens",)}
    carried = carried_features(units, receivers)
    assert carried["llm.embed_tokens"] == {"vision": 2} and carried["llm.layers.0"] == {"vision": 1}
    assert all(not carried[n] for n in ("llm.layers.1", "llm.layers.2", "llm.norm", "llm.lm_head"))
    with pytest.raises(ValueError, match="5 DeepStack receivers, the LLM has 4 layer units"):
        feature_receivers(units, {"vision": 5})
    with pytest.raises(ValueError, match=r"deepstack names \['video'\]"):
        feature_receivers(units, {"video": 1})


def test_the_cost_model_counts_the_deepstack_mergers_features_and_carried_bytes():
    units = units_from_configs(_configs())
    with_ds = {u.name: e for u, e in zip(units, unit_estimates(units, _configs(), SHAPES, "bfloat16"))}
    plain = {u.name: e for u, e in zip(units, unit_estimates(units, _configs(0), SHAPES, "bfloat16"))}
    row = VISUAL * H * 2  # one feature of the LLM width per visual token, bf16
    norm, proj = "encoders.vision.post_norm", "encoders.vision.projector"
    assert with_ds[norm].weight_flops == 3 * plain[norm].weight_flops  # the merger and two DeepStack mergers
    assert with_ds[norm].params - plain[norm].params == 2 * (2 * MERGE_IN + MERGE_IN**2 + MERGE_IN + MERGE_IN * H + H)
    assert with_ds[norm].output_bytes == 3 * row and with_ds[proj].output_bytes == 3 * plain[proj].output_bytes == 3 * row
    extra = {n: (with_ds[n].output_bytes - plain[n].output_bytes, with_ds[n].activation_bytes - plain[n].activation_bytes)
             for n in plain if n.startswith("llm.")}
    assert extra == {"llm.embed_tokens": (2 * row, 0), "llm.layers.0": (row, row), "llm.layers.1": (0, row),
                     "llm.layers.2": (0, 0), "llm.layers.3": (0, 0), "llm.norm": (0, 0), "llm.lm_head": (0, 0)}
    assert with_ds["llm.layers.2"] == plain["llm.layers.2"] and with_ds["encoders.audio.projector"] == plain[
        "encoders.audio.projector"]


def test_a_stage_boundary_between_the_receivers_carries_their_features():
    units = units_from_configs(_configs())
    costs = {ds: dict(zip([u.name for u in units], unit_costs(units, _configs(ds), SHAPES, DeviceSpec.h100())))
             for ds in (0, 2)}
    plan = plan_pipeline(units, "encoder_parallel", splits={"llm": ["llm.layers.1"]},
                         stages_per_module={"vision": 1, "audio": 1})
    first_llm = plan.llm_stages[0]
    sent = {ds: boundary_bytes_from_units(plan, costs[ds]) for ds in costs}
    assert sent[2][first_llm] - sent[0][first_llm] == VISUAL * H * 2  # layer 1's features, with the hidden states
    assert sent[2][plan.llm_stages[1]] == sent[0][plan.llm_stages[1]]  # the loss: nothing after the last receiver


def test_a_deepstack_tower_is_one_stage_in_plans_and_in_the_search():
    units = units_from_configs(_configs())
    joined = [u.name for u in units if u.joined]
    assert joined == ["encoders.vision.layers.0", "encoders.vision.layers.1", "encoders.vision.post_norm"]
    assert not any(u.joined for u in units_from_configs(_configs(0)))
    with pytest.raises(ValueError, match="starts at unit 'encoders.vision.layers.1', which stays in the stage"):
        plan_pipeline(units, "encoder_parallel", splits={"vision": ["encoders.vision.layers.1"]})
    plan_pipeline(units, "encoder_parallel", splits={"vision": ["encoders.vision.projector"]})  # after the tower
    # a tower heavy enough that an unconstrained search cuts it
    heavy = {**_configs(), "vision": dataclasses.replace(VISION, layers=8, hidden=1024, heads=16, head_dim=64,
                                                         intermediate=4096, merger=(4096, H))}
    shapes = dict(SHAPES, vision=MicrobatchShape(16000))
    units = units_from_configs(heavy)
    free = [dataclasses.replace(u, joined=False) for u in units]
    costs = unit_costs(units, heavy, shapes, DeviceSpec.h100())

    def vision_stages(us) -> int:
        space = SearchSpace(dp_degrees=(1,), tp_degrees=(1,), dp_shard_degrees=(1,), checkpointing=("none",))
        plan = plan_parallel(us, costs, 8, microbatches=8, space=space).plan
        return sum("vision" in s.modules for s in plan.stages)

    assert vision_stages(free) > 1 and vision_stages(units) == 1
