"""The router's measured load in a job's profile: ``plait profile`` of a MoE job (the demo job with a Qwen3-MoE LLM
of 64 experts, top-2) stores per MoE layer the tokens its router sent to each expert; they sum to the microbatch's
tokens x top-k and equal the counts of the routers' own outputs. ``plait plan`` reads them from the store: with
every token folded onto experts 0 and 1 (a forward hook on the routers) the EP plans pay the imbalance (the EP
rank holding experts 0-31 gets all the routed work) and are predicted slower than with uniform routing."""

from __future__ import annotations

import dataclasses
import io
import math

import torch

from plait.commands.plan.command import plan_setup
from plait.measure.job_profile import ProfileStore, build_profile_inputs, profile_job
from plait.measure.router_load import router_modules
from plait.measure.unit_timing import measure_profile
from plait.train.plan_search import search_plan
from tests.distributed.ep_worker import fold_routes
from tests.helpers.moe import DEMO, OVERRIDES

K = 2


def own_counts(model, batches, llm_kwargs) -> dict[str, list[int]]:
    """Per router (by its layer's name), the bincount of the top-k ids it returned over one forward per batch."""
    seen: dict[str, list[int]] = {}
    handles = [r.register_forward_hook(
        lambda m, _i, out, n=name.rsplit(".mlp.", 1)[0]: seen.setdefault(n, []).append(out[2]))
        for name, r in router_modules(model)]
    with torch.no_grad():
        for b in batches:
            model(b.input_ids, b.modality_inputs, b.attention_mask, b.position_ids,
                  rope_position_ids=b.rope_position_ids, use_cache=False, **llm_kwargs(b))
    for h in handles:
        h.remove()
    return {n: torch.bincount(torch.cat([i.reshape(-1) for i in ids]), minlength=64).tolist()
            for n, ids in seen.items()}


def test_profile_stores_router_load_and_plan_reads_it(tmp_path):
    setup = plan_setup(DEMO, 2, overrides=OVERRIDES, device="cpu-preset", profile_store=tmp_path / "none")
    assert setup.router_load == {}
    cfg = setup.cfg
    profile = profile_job(cfg, store_dir=tmp_path / "uniform", repeats=1, warmup=0, out=io.StringIO())
    inputs = build_profile_inputs(cfg, device="cpu")
    tokens = sum(b.input_ids.numel() for b in inputs.microbatches)
    layers = [u.name for u in profile.units if u.module == "llm" and u.kind == "layer"]
    assert sorted(profile.router_load) == sorted(layers) and len(layers) == 4
    for name in layers:
        assert len(profile.router_load[name]) == 64 and sum(profile.router_load[name]) == tokens * K
    assert {n: [int(c) for c in v] for n, v in profile.router_load.items()} == own_counts(
        inputs.model, inputs.microbatches, inputs.llm_kwargs)
    stored, why = ProfileStore(tmp_path / "uniform").load(inputs.key)
    assert why == "hit" and stored.router_load == profile.router_load

    # every token to experts 0 and 1: the profile says so, and the plan charges EP = 2 for it
    fold_routes(inputs.model)
    skewed = measure_profile(inputs.model, inputs.microbatches, inputs.key, repeats=1, warmup=0,
                             llm_kwargs=inputs.llm_kwargs, autocast=inputs.autocast)
    for name in layers:
        load = skewed.router_load[name]
        assert load[0] + load[1] == tokens * K and not any(load[2:])
    ProfileStore(tmp_path / "skewed").save(skewed)
    measured = plan_setup(DEMO, 2, overrides=OVERRIDES, device="cpu-preset", profile_store=tmp_path / "skewed")
    assert measured.router_load == skewed.router_load
    uniform = dataclasses.replace(measured, router_load={})
    with_load = search_plan(measured, 2, 0.9, ep_degrees=(2,))
    without = search_plan(uniform, 2, 0.9, ep_degrees=(2,))
    assert with_load.ep == without.ep == 2
    assert with_load.iteration_s > without.iteration_s and not math.isclose(with_load.iteration_s,
                                                                            without.iteration_s, rel_tol=1e-6)
    # one process runs every expert: no imbalance at EP = 1
    assert math.isclose(search_plan(measured, 2, 0.9, ep_degrees=(1,)).iteration_s,
                        search_plan(uniform, 2, 0.9, ep_degrees=(1,)).iteration_s, rel_tol=1e-9)
