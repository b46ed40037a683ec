"""The glue a pipeline stage chunk pays beyond its units, and the runtime's own cost per action (step 4 of
:mod:`plait.measure.unit_timing`).

Each module (every encoder branch, the LLM) is run as one pipeline stage by the runtime's stage code
(``build_rank_stages`` on a copy of the model, payloads handed over as the runtime does, all forwards then all
backwards); the measured ``F`` and ``B`` times minus the sum of the module's unit costs is the glue a stage chunk of
that module pays once per action (rotary embeddings and mask construction of an LLM chunk, feature placement, the
loss, the stage wrapper). A stage whose input needs a gradient (the LLM's, when an encoder trains) also runs its
backward split as zero-bubble schedules do (``B_split``, ``W_split``: the runtime's ``input_gradients`` then
``weight_gradients``), less its units' split costs. The same stages are also run by the runtime's executor
(``run_pipeline_step`` in this process): its time beyond the stage passes, per action, is the executor's own cost
per action (``Profile.action_overhead_s``).
"""

from __future__ import annotations

import copy
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from plait.data.collate import Batch
from plait.models.multimodal import MultimodalModel
from plait.models.units import unit_specs
from plait.parallel.pipeline import run_pipeline_step
from plait.parallel.pipeline.split_backward import input_gradients, weight_gradients
from plait.parallel.stages import build_rank_stages
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.schedules import build_schedule
from plait.train.loss import token_loss_sum

__all__ = ["chunk_overhead", "module_chunk_times"]

KwargsFn = Callable[[Batch], Mapping[str, Any]]

def module_chunk_times(model: MultimodalModel, microbatches: Sequence[Batch], llm_kwargs: KwargsFn,
                        autocast: Callable[[], AbstractContextManager],
                        timer: Any) -> tuple[dict[str, dict[str, float]], float]:
    """Per module, the ``F`` and ``B`` seconds per microbatch of a pipeline stage holding the whole module
    (the runtime's ``PipelineStage``, payloads handed over as the runtime does; median over repetitions,
    mean over microbatches), on a copy of ``model``; and the runtime's own cost per action (seconds): one
    ``run_pipeline_step`` of the same stages in this process (GPipe, one microbatch) minus the stage passes,
    per action (the executor's bookkeeping; P2P transfers are not in it). ``timer``: the profiler's timer
    (``now()``, ``repeats``, ``warmup``)."""
    work = copy.deepcopy(model)
    units = tuple(s.unit for s in unit_specs(work))
    plan = plan_pipeline(units, "encoder_parallel")
    plan = plan_pipeline(units, "encoder_parallel", ranks=[0] * plan.num_stages)
    stages = build_rank_stages(work, plan, 0)
    stages.train()
    totals: dict[tuple[int, str], float] = defaultdict(float)
    schedule = build_schedule(plan, "gpipe", 1)
    excess = []
    for batch in microbatches:
        runs: dict[tuple[int, str], list[float]] = defaultdict(list)
        steps, passes = [], []
        for i in range(timer.warmup + timer.repeats):
            times = _stage_pass(stages, plan, batch, llm_kwargs, autocast, timer)
            start = timer.now()
            run_pipeline_step(stages, schedule, [batch], batch.target_tokens, autocast=autocast,
                              llm_kwargs=[llm_kwargs(batch)], loss_fn=token_loss_sum)
            step = timer.now() - start
            _clear_grads(stages)
            split = _stage_pass(stages, plan, batch, llm_kwargs, autocast, timer, split=True)
            _clear_grads(stages)
            if i >= timer.warmup:
                steps.append(step)
                passes.append(sum(times.values()))
                for key, value in (times | split).items():
                    runs[key].append(value)
        for key, values in runs.items():
            totals[key] += statistics.median(values) / len(microbatches)
        actions = sum(len(a) for a in schedule.actions)
        excess.append(max(0.0, statistics.median(steps) - statistics.median(passes)) / actions)
    chunks = {stage.modules[0]: {kind: totals[(stage.index, kind)] for kind in ("F", "B", "B_split", "W_split")
                                 if (stage.index, kind) in totals} for stage in plan.stages}
    return chunks, sum(excess) / len(excess)


def _clear_grads(stages: Any) -> None:
    for _, p in stages.trainable_parameters():
        p.grad = None


def _stage_pass(stages: Any, plan: Any, batch: Batch, llm_kwargs: KwargsFn,
                autocast: Callable[[], AbstractContextManager], timer: Any,
                split: bool = False) -> dict[tuple[int, str], float]:
    """One forward of every stage in order, then every backward in reverse; seconds per (stage, kind): ``F`` and
    ``B``, or with ``split`` the backward split as zero-bubble schedules run it (:func:`_split_backward`):
    ``B_split`` and ``W_split`` of the stages whose input needs a gradient (the others run it unsplit)."""
    outs: dict[int, Any] = {}
    inputs: dict[int, Any] = {}
    times: dict[tuple[int, str], float] = {}
    for st in plan.stages:
        stage = stages.stages[st.index]
        received = {p: {m: [t.detach().requires_grad_(
            plan.stages[p].runs_backward and t.requires_grad and t.is_floating_point()
            and stage.module_runs_grad(m if m in stage.chunks else "llm")) for t in lst]
            for m, lst in outs[p].items()} for p in plan.predecessors(st.index)}
        start = timer.now()
        with torch.set_grad_enabled(st.runs_backward), autocast():
            outs[st.index] = stage.forward(batch, received, token_loss_sum, llm_kwargs(batch))
        if not split:
            times[(st.index, "F")] = timer.now() - start
        inputs[st.index] = received
    for st in reversed(plan.stages):
        pairs = _backward_pairs(stages.stages[st.index], plan, st.index, outs, inputs)
        leaves = [t for payload in inputs[st.index].values() for lst in payload.values() for t in lst
                  if t.requires_grad]
        if split and st.runs_backward and pairs and leaves:
            times.update(_split_backward(stages.stages[st.index], st.index, pairs, leaves, autocast, timer))
            continue
        start = timer.now()
        if st.runs_backward and pairs:
            with autocast():
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if not split:
            times[(st.index, "B")] = timer.now() - start
    return times


def _split_backward(stage: Any, index: int, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                    leaves: list[torch.Tensor], autocast: Callable[[], AbstractContextManager],
                    timer: Any) -> dict[tuple[int, str], float]:
    """The runtime's split backward of one stage (``PipelineExecutor._input_grads`` then ``weight_gradients``):
    ``B`` = the input gradients into the leaves' ``.grad``, ``W`` = the stage's trainable weights' gradients
    from what ``B`` kept; seconds of each."""
    params = [p for p in stage.params if p.requires_grad]
    start = timer.now()
    with autocast():
        found, kept = input_gradients(pairs, leaves, params)
    for leaf, grad in zip(leaves, found):
        leaf.grad = grad
    middle = timer.now()
    with autocast():
        weight_gradients(kept)
    return {(index, "B_split"): middle - start, (index, "W_split"): timer.now() - middle}


def _backward_pairs(stage: Any, plan: Any, index: int, outs: Mapping[int, Any],
                    inputs: Mapping[int, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(output, gradient)`` pairs of a stage's backward: the loss on the last stage, else the gradients its
    successor left on the received leaves."""
    if stage.is_last:
        loss = outs[index]["llm"][0]
        return [(loss, torch.ones_like(loss))] if loss.requires_grad else []
    (succ,) = plan.successors(index)
    pairs = []
    for module, tensors in outs[index].items():
        for out, leaf in zip(tensors, inputs[succ][index].get(module, [])):
            if out.requires_grad and leaf.grad is not None:
                pairs.append((out, leaf.grad))
    return pairs


def chunk_overhead(chunks: Mapping[str, Mapping[str, float]], profile_units: Sequence[Any],
                   costs: Sequence[Any]) -> dict[str, dict[str, float]]:
    """Chunk time minus the sum of its units' forward / (frozen-aware) backward, per module; where the chunk's
    split backward was timed (``B_split``, ``W_split``: its input needs a gradient) also those minus the units'
    split ``B`` and ``W`` (``UnitCost.split_backward_s``)."""
    out: dict[str, dict[str, float]] = {}
    for module, times in chunks.items():
        pairs = [(u, c) for u, c in zip(profile_units, costs) if u.module == module]
        forward = sum(c.forward_s for _, c in pairs)
        backward = sum(c.backward_s(u) for u, c in pairs)
        runs_backward = any(u.runs_backward for u, _ in pairs)
        out[module] = {"F": times["F"] - forward, "B": (times["B"] - backward) if runs_backward else 0.0}
        if "B_split" in times and "W_split" in times:
            split = [c.split_backward_s(u) for u, c in pairs]
            out[module]["B_split"] = times["B_split"] - sum(b for b, _ in split)
            out[module]["W_split"] = times["W_split"] - sum(w for _, w in split)
    return out
