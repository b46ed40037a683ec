"""Activation checkpointing at runtime (issue 14, item 4): non-reentrant, per layer unit, frozen-aware.

Gradients equal to no checkpointing (fp32, 1e-6) in every freezing mode, single process, through the composite
model, through a pipeline rank holding every stage (1F1B and split backward) and through the Trainer with
deferred encoder outputs; frozen units are never recomputed (forward calls counted); autograd keeps fewer
bytes with checkpointing for a trainable LLM and the same for a frozen module (saved tensors counted)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from plait.models.units import model_units
from plait.parallel.activation_checkpointing import apply_activation_checkpointing, checkpoint_policy, is_checkpointed
from plait.parallel.pipeline import run_pipeline_step
from plait.parallel.stages import build_rank_stages
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.schedules import build_schedule
from plait.train.loss import token_loss_sum
from plait.train.trainer import Trainer
from tests.distributed.pipeline_worker import COLOC, ENC_PAR, make_batch, reference_step, tiny_model
from tests.helpers.deferral import deferral_records
from tests.helpers.checkpointing import MODES, frozen_model

BATCHES = ("iva", "t", "ia")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _grads(named) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in named if p.grad is not None}


def _assert_same_grads(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys() and expected
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, rtol=0, atol=1e-6, msg=name)


def _layer_calls(model) -> dict[str, list[int]]:
    """Per layer unit, a counter of its first submodule's forward calls (a recomputation calls them again)."""
    counts: dict[str, list[int]] = {}
    for unit in model_units(model):
        if unit.kind == "layer":
            child = next(model.get_submodule(unit.name).children())
            counts[unit.name] = [0]
            child.register_forward_pre_hook(lambda *_, c=counts[unit.name]: c.__setitem__(0, c[0] + 1))
    return counts


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("mode", list(MODES))
def test_single_process_gradients_equal_no_checkpointing(mode, policy):
    ref = frozen_model(mode)
    model = copy.deepcopy(ref)
    units = model_units(model)
    done = apply_activation_checkpointing(model, policy)
    batches = [make_batch(k, i) for i, k in enumerate(BATCHES)]
    assert reference_step(model, batches) == pytest.approx(reference_step(ref, batches), rel=1e-6)
    _assert_same_grads(_grads(model.named_parameters()), _grads(ref.named_parameters()))
    layers = [u for u in units if u.kind == "layer"]
    assert set(done) <= {u.name for u in layers if u.runs_backward}
    if policy == "full":
        assert set(done) == {u.name for u in layers if u.runs_backward}
    else:
        assert "language_model.model.layers.0" in done and "language_model.model.layers.1" not in done


def test_recomputes_exactly_the_checkpointed_layers_and_never_frozen_ones():
    """Forward calls counted: a checkpointed layer runs twice per forward (once more in the backward), every
    other layer once, and the frozen encoders (no backward) never more than their plain runs."""
    batches = [make_batch(k, i) for i, k in enumerate(BATCHES)]
    plain = frozen_model("frozen-encoders")
    plain_calls = _layer_calls(plain)
    reference_step(plain, batches)
    model = frozen_model("frozen-encoders")
    calls = _layer_calls(model)
    done = apply_activation_checkpointing(model, "full")
    reference_step(model, batches)
    assert done == ["language_model.model.layers.0", "language_model.model.layers.1"]
    for name, count in calls.items():
        assert count[0] == plain_calls[name][0] * (2 if name in done else 1) > 0, name


def _saved_bytes(model, batches) -> int:
    """Bytes of the distinct tensor storages kept for backward over one training step: what autograd saves plus
    the tensor arguments checkpointed layers hold for their recomputation."""
    seen: dict[int, int] = {}
    alive: list[torch.Tensor] = []  # held to the end so no storage address is reused within the step

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        alive.append(t)
        return t

    def held(module, args, kwargs) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and torch.is_grad_enabled():
                pack(value)

    hooks = [m.register_forward_pre_hook(held, with_kwargs=True) for m in model.modules() if is_checkpointed(m)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        reference_step(model, batches)
    for hook in hooks:
        hook.remove()
    return sum(seen.values())


def test_checkpointing_saves_fewer_activation_bytes_for_a_trainable_llm_and_none_less_for_frozen_encoders():
    batches = [make_batch(k, i) for i, k in enumerate(BATCHES)]
    sizes = {}
    for policy in ("none", "selective", "full"):
        model = frozen_model("frozen-encoders")
        apply_activation_checkpointing(model, policy)
        sizes[policy] = _saved_bytes(model, batches)
    assert sizes["full"] < sizes["selective"] < sizes["none"]
    # frozen encoders (no backward) asked to checkpoint: nothing checkpointed, the same bytes kept
    model = frozen_model("frozen-encoders")
    assert apply_activation_checkpointing(model, "none", {"vision": "full", "audio": "full"}) == []
    assert _saved_bytes(model, batches) == sizes["none"]


def test_apply_twice_and_bad_policies_are_refused():
    model = tiny_model()
    apply_activation_checkpointing(model, "full")
    assert is_checkpointed(model.get_submodule("language_model.model.layers.0"))
    assert not is_checkpointed(model.get_submodule("language_model.model.embed_tokens"))
    with pytest.raises(ValueError, match="already activation-checkpointed"):
        apply_activation_checkpointing(model, "full")
    with pytest.raises(ValueError, match="of llm: 'half'"):
        apply_activation_checkpointing(tiny_model(), "none", {"llm": "half"})
    # parameter names are unchanged (checkpoints, optimizer groups and stage pruning key on them)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in tiny_model().named_parameters()]


def test_checkpoint_policy_reads_the_job_fields(tiny_job):
    cfg = tiny_job(deferral_records()[:2], train={"activation_checkpointing": "selective"})
    cfg.model.llm.activation_checkpointing = "full"
    name = next(iter(cfg.model.encoders))
    cfg.model.encoders[name].activation_checkpointing = "none"
    assert checkpoint_policy(cfg) == ("selective", {"llm": "full", name: "none"})


@pytest.mark.parametrize("split", [False, True], ids=["1f1b", "split-backward"])
@pytest.mark.parametrize("mode", list(MODES))
def test_pipeline_stages_on_one_rank_equal_no_checkpointing(mode, split):
    """All stages of a PP plan on one rank: checkpointed layers inside stage chunks (encoder layers run one by one,
    LLM chunks through the HF stack with its kwargs), fused and split (dX then dW over the retained graph)."""
    layout = COLOC if split else ENC_PAR
    results = []
    for policy in ("none", "full"):
        model = frozen_model(mode)
        calls = _layer_calls(model)
        done = apply_activation_checkpointing(model, policy)
        plan = plan_pipeline(model_units(model), layout["layout"], stages_per_module=layout["stages_per_module"])
        plan = plan.replace(stages=tuple(dataclasses.replace(s, rank=0) for s in plan.stages))
        stages = build_rank_stages(model, plan, 0)
        options = {"split_backward": True, "defer_weight_grad": True} if split else {}
        schedule = build_schedule(plan, "1f1b", 3, **options)
        assert schedule.split_backward == split
        batches = [make_batch(k, i) for i, k in enumerate(BATCHES)]
        res = run_pipeline_step(stages, schedule, batches, sum(b.target_tokens for b in batches),
                                loss_fn=token_loss_sum)
        results.append((res.loss, _grads(stages.trainable_parameters()), calls, done))
    (_, _, plain, _), (_, _, calls, done) = results
    assert done and all(calls[n][0] > plain[n][0] if n in done else calls[n][0] == plain[n][0] for n in calls)
    # dX then dW over the retained graph: each pass recomputes (planner.recompute charges both); with only the
    # projectors training, the checkpointed (frozen) LLM layers have no dW pass
    if split and mode != "projectors-only":
        assert any(calls[n][0] - plain[n][0] > plain[n][0] for n in done)
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-6)
    _assert_same_grads(results[1][1], results[0][1])


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable-encoders", "frozen-encoders"])
def test_trainer_with_deferral_equals_no_checkpointing(tiny_job, frozen):
    """The Trainer's setup applies the job's policy; deferred encoder outputs (re-injected as detached leaves,
    their backward run later) give the same gradients and losses as without checkpointing."""
    runs = []
    for policy in ("none", "full"):
        cfg = tiny_job(deferral_records(), data={"shuffle": False},
                       train={"steps": 2, "global_batch_size": 8, "microbatch_size": 2,
                              "microbatch_policy": "hierarchical", "activation_checkpointing": policy})
        for enc in cfg.model.encoders.values():
            enc.freeze = frozen
        trainer = Trainer.build(cfg)
        plan, _ = trainer.plan_step(list(range(8)))
        assert plan.deferred(), "the mix must make the planner defer"
        trainer.forward_backward(list(range(8)), plan)
        grads = _grads(trainer.model.named_parameters())
        trainer.optimizer.zero_grad(set_to_none=True)
        losses = [trainer.train_step(list(range(8))).loss for _ in range(2)]
        checkpointed = [n for n, m in trainer.model.named_modules() if is_checkpointed(m)]
        runs.append((grads, losses, checkpointed))
    assert not runs[0][2] and runs[1][2]
    assert any(".encoder." in n for n in runs[1][2]) != frozen
    _assert_same_grads(runs[1][0], runs[0][0])
    assert runs[1][1] == pytest.approx(runs[0][1], rel=1e-6)


def test_lora_units_are_checkpointed_with_equal_adapter_gradients():
    """LoRA (issue 15) on the LLM and the vision encoder: the adapted layers train (adapters only) and are
    checkpointed; adapter gradients equal those without checkpointing."""
    from plait.config.schema import EncoderConfig, LLMConfig, LoraConfig, ModelConfig
    from plait.models.lora import apply_lora

    model = tiny_model()
    apply_lora(model, ModelConfig(llm=LLMConfig(lora=LoraConfig(r=4)),
                                  encoders={"vision": EncoderConfig(lora=LoraConfig(r=4))}))
    with torch.no_grad():  # non-zero B so every adapter weight gets a gradient
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    ref = copy.deepcopy(model)
    done = apply_activation_checkpointing(model, "full")
    assert "language_model.model.layers.1" in done and any(".encoder." in n for n in done)
    batches = [make_batch(k, i) for i, k in enumerate(BATCHES)]
    assert reference_step(model, batches) == pytest.approx(reference_step(ref, batches), rel=1e-6)
    grads = _grads(model.named_parameters())
    assert any("lora_A" in n for n in grads)
    _assert_same_grads(grads, _grads(ref.named_parameters()))
