"""Helpers of several test modules, taken from tests/unit/models/test_meta_init.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import pytest
import torch

import plait.parallel.stages as stages_mod
from plait.models.init import init_weights, materialize, meta_tensor_names, rank_prefixes, weight_source
from plait.models.registry import apply_freezing, build_model, compose_model, load_tokenizer
from plait.models.units import model_units, unit_specs
from plait.planner.pipeline.plan import plan_pipeline
from tests.helpers.jobs import tiny_config_dict


SEED = 7


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tiny_config_dict("unused.jsonl")["data"]["tokenizer"])


def tensors(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    for name, t in got.items():
        r = ref[name]
        assert t.dtype == r.dtype and t.requires_grad == r.requires_grad, name
        assert torch.equal(t, r), name


def eager_reference(cfg, tok):
    """The old way: HF constructors on the CPU, freezing, then the per-module init over every tensor."""
    ref = compose_model(cfg, tok)
    apply_freezing(ref, cfg)
    init_weights(ref, SEED)
    return ref


def rank_share(full, plan, rank) -> set[str]:
    """Tensor names a rank must hold, from the full model: its units' tensors plus LLM tensors in no unit."""
    specs = unit_specs(full)
    mine = {u for s in plan.stages_on_rank(rank) for u in plan.stages[s].units}
    names = {f"{m}.{n}" for s in specs if s.unit.name in mine for m in s.modules
             for n in tensors(full.get_submodule(m))}
    in_units = {f"{m}.{n}" for s in specs for m in s.modules for n in tensors(full.get_submodule(m))}
    return names | {n for n in tensors(full) if n.startswith("language_model.") and n not in in_units}


def check_ranks(cfg, tok, full, split=None):
    """Materialise each rank of a 4-stage encoder-parallel plan (stages per module ``split``, default one per
    encoder and two for the LLM) on a fresh meta model, prune it with ``build_rank_stages`` and compare with
    ``full``. Returns the plan and the parameter count each rank holds."""
    ref = tensors(full)
    split = split or {"vision": 1, "audio": 1, "llm": 2}
    plan = plan_pipeline(model_units(full), "encoder_parallel", stages_per_module=split)
    assert plan.num_ranks == 4
    counts = []
    for rank in range(4):
        model = build_model(cfg, tok, device="meta")
        units = {u for s in plan.stages_on_rank(rank) for u in plan.stages[s].units}
        done = materialize(model, "cpu", SEED, keep=rank_prefixes(model, units), source=weight_source(cfg, model))
        share = rank_share(full, plan, rank)
        aliases: dict[int, tuple[torch.Tensor, list[str]]] = {}  # tied weights have two names
        for name, t in tensors(model).items():
            aliases.setdefault(id(t), (t, []))[1].append(name)
        for t, names in aliases.values():  # before pruning: the rest of the composite was never allocated
            assert t.is_meta != any(n in share for n in names), names
        assert set(done) == {n for t, names in aliases.values() if not t.is_meta for n in names}
        stages = stages_mod.build_rank_stages(model, plan, rank, "cpu")
        held = tensors(stages.model)
        assert set(held) == share and not meta_tensor_names(stages.model)
        assert_same(held, ref)
        counts.append(sum(p.numel() for p in stages.model.parameters()))
    return plan, counts
