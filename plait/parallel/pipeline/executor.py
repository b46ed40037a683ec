"""Runs one rank's actions of one pipeline step (state of that step only).

Transfers follow the plan's edges: ``F(s, m)`` receives the payload of every predecessor and sends its output to
its successor; ``B(s, m)`` receives the output gradient from the successor and sends the input gradient of each
branch back to the predecessors that run backward. Stages on the same rank hand payloads over locally.

Frozen-aware execution: a stage that runs no backward runs its forward under ``no_grad`` and
keeps nothing; a frozen stage that needs an input gradient keeps its activations and its backward computes input
gradients only (its parameters have ``requires_grad`` False). With ``split_backward`` schedules ``B`` computes
input gradients (graph retained) and ``W`` weight gradients from the gradients ``B`` kept where the weights meet
the activations (:mod:`plait.parallel.pipeline.split_backward`): together one backward's work, not two.

Forward-only schedules (``schedules.forward_only``, evaluation): every forward runs without autograd and keeps
nothing; the last stage's ``loss_fn`` output of each microbatch is collected in ``losses``.

Deferred encoder outputs (:class:`~plait.planner.microbatch.routing.FeatureRouting`): the schedule and its messages stay as
they are (``F``/``B`` of microbatch ``m`` on every stage): encoder stages run microbatch ``m`` of the encoder
view, LLM stages microbatch ``m`` of the LLM view. The first LLM stage keeps the features each branch sent for
encoder microbatch ``i`` until the ``F`` of the last LLM microbatch reading them
(:class:`~plait.parallel.deferral.FeatureBuffer`; the bytes are counted), and builds each LLM microbatch's
features as a fresh leaf. Its ``B(j)`` sends the gradient of exactly those features; an encoder stage's
``B(j)``/``W(j)`` cut it per sample (:func:`~plait.parallel.deferral.split_feature_grad`) and back-propagate each
piece through the graph of the encoder microbatch that produced it (retaining a graph while a later LLM
microbatch still has gradients for it), and send upstream, per such encoder microbatch, the partial input
gradients. By linearity the pieces sum to one fused backward.

Under FSDP2 (``StepInputs.sharded``) the actions run no collective of FSDP2's (the stage's parameters are gathered
before the step); right after each stage's last backward action the executor reduces that stage's gradients
(``ShardedModel.reduce_gradients``), at the same action on every shard rank.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from plait.data.collate import Batch
from plait.parallel.deferral import FeatureBuffer, split_feature_grad
from plait.parallel.encoder_rows import gradient_source, sent_payload
from plait.parallel.energy import FrequencyController
from plait.parallel.fsdp import ShardedModel
from plait.parallel.pipeline.comm import PipelineComm
from plait.parallel.pipeline.split_backward import WeightGradients, input_gradients, weight_gradients
from plait.parallel.pipeline.transport import MessageKey, Transport
from plait.parallel.stages import Payload, PipelineStage, RankStages
from plait.planner.microbatch.routing import FeatureRouting
from plait.planner.pipeline.schedule_ir import Action, Schedule, frees_activations
from plait.planner.pipeline.types import TimelineEvent
from plait.planner.types import LLM_MODULE

__all__ = ["Executor", "StepInputs"]

_Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (output, its gradient) to back-propagate


@dataclass(frozen=True)
class StepInputs:
    """What one step executes, planned before it runs (``run_pipeline_step`` builds it).

    Attributes:
        microbatches: the LLM view's batches (None: an LLM microbatch without samples, only with ``routing``).
        llm_kwargs: per LLM microbatch, the extra keyword arguments of the LLM stages (attention metadata).
        scale: factor of every microbatch's loss gradient (``1 / global target tokens``).
        loss_fn: ``(logits [B, N, V], labels [B, N]) -> scalar`` sum of token losses.
        autocast: context factory wrapped around every action.
        instrument: count tensors saved for backward per stage.
        routing: deferred encoder outputs (None: encoder and LLM views are ``microbatches``).
        encoder_batches: with ``routing``, per microbatch the batch the encoder stages run (None: no sample).
        frequency: sets (on GPU) or records (on CPU) each action's SM frequency before it runs, from an energy
            plan (:mod:`plait.parallel.energy`); the frequency goes into the action's timeline event. None: none.
        sharded: this rank's FSDP2 groups (``parallel.dp_shard`` > 1), unsharded by ``ShardedModel.begin_step``:
            each stage's groups are reduced right after its last backward action (:mod:`plait.parallel.fsdp`).
    """

    microbatches: Sequence[Batch | None]
    llm_kwargs: Sequence[Mapping[str, Any]]
    scale: float
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    autocast: Callable[[], AbstractContextManager] = nullcontext
    instrument: bool = False
    routing: FeatureRouting | None = None
    encoder_batches: Sequence[Batch | None] = ()
    frequency: FrequencyController | None = None
    sharded: ShardedModel | None = None


@dataclass
class _Record:
    """What a stage keeps of one microbatch between its forward and its last backward action."""

    inputs: dict[int, Payload]
    outputs: Payload
    out_grads: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    kept: WeightGradients | None = None  # split backward: what B kept for W


class Executor:
    """Runs this rank's actions of ``schedule`` on ``inputs`` (module docstring); ``losses``, ``events``,
    ``saved``, ``backwards`` and ``buffer`` hold what the step measured."""

    def __init__(self, stages: RankStages, schedule: Schedule, comm: PipelineComm, inputs: StepInputs) -> None:
        self.stages, self.plan, self.schedule, self.comm, self.inputs = stages, schedule.plan, schedule, comm, inputs
        self.routing = inputs.routing
        self.forward_only = all(a.kind == "F" for _, a in schedule.all_actions())  # evaluation: keep nothing
        self.transport = Transport(comm, schedule) if comm.distributed else None
        self.local: dict[MessageKey, Any] = {}
        self.records: dict[tuple[int, int], _Record] = {}
        self.losses: list[torch.Tensor] = []
        self.events: list[TimelineEvent] = []
        self.saved: dict[int, int] = {s: 0 for s in stages.stages}
        self.backwards: dict[int, int] = {s: 0 for s in stages.stages}
        self.buffer = FeatureBuffer(self.routing) if self.routing is not None else None
        self.users_left: dict[tuple[int, int], set[int]] = {}  # routed encoder records: LLM microbatches to come
        self.shares: dict[tuple[int, int], dict[int, _Pairs]] = {}  # routed (s, j): per record i, its pairs
        self.kept: dict[tuple[int, int, int], WeightGradients | None] = {}  # routed split (s, i, j): B kept for W
        self.mhz = 0  # the SM frequency set before the current action (0: no energy plan)

    def run(self) -> None:
        """Every action of this rank, in schedule order (under FSDP2 each stage's gradients reduced after its last
        backward action, :meth:`_reduce_sharded`); then wait for the sends."""
        actions = self.schedule.actions[self.comm.pp_rank]
        last = {a.stage: k for k, a in enumerate(actions) if a.kind != "F"}  # each stage's last backward action
        for k, action in enumerate(actions):
            if self.inputs.frequency is not None:
                self.mhz = self.inputs.frequency.before(action.kind, action.stage, action.microbatch)
            if action.kind == "F":
                self._forward(action.stage, action.microbatch)
            elif self._routed(action.stage):
                self._backward_routed(action)
            else:
                self._backward(action)
            if last.get(action.stage) == k:
                self._reduce_sharded(action.stage)
        for s in sorted(set(self.stages.stages) - set(last)):  # a stage without backward actions
            self._reduce_sharded(s)
        if self.transport is not None:
            self.transport.finish()

    def _reduce_sharded(self, s: int) -> None:
        """Under FSDP2, reduce stage ``s``'s gradients of the step (``ShardedModel.reduce_gradients``: a collective
        over its shard ranks, which run the same schedule, so they reach it at the same action)."""
        sharded = self.inputs.sharded
        if sharded is None or self.forward_only:
            return
        groups = sharded.groups_of(set(self.plan.stages[s].units))
        if groups:
            sharded.reduce_gradients(groups)

    def _routed(self, s: int) -> bool:
        """An encoder stage under a routing: its microbatch ``i`` is the encoder view's."""
        return self.routing is not None and LLM_MODULE not in self.stages.stages[s].chunks

    # -- transfers
    def _take(self, key: MessageKey) -> Any:
        if key in self.local:
            return self.local.pop(key)
        if self.transport is None:
            raise RuntimeError(f"message {key} crosses ranks but torch.distributed is not initialised")
        return self.transport.receive(key)

    def _give(self, key: MessageKey, payload: Mapping[str, Sequence[torch.Tensor | None]]) -> None:
        if self.plan.stages[key[2]].rank == self.comm.pp_rank:
            self.local[key] = {m: [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in lst]
                               for m, lst in payload.items()}
        else:
            assert self.transport is not None  # a remote stage implies a process group (checked in _take)
            self.transport.send(key, payload)

    # -- forward
    def _forward(self, s: int, m: int) -> None:
        stage: PipelineStage = self.stages.stages[s]
        received = {p: self._take(("F", p, s, m)) for p in self.plan.predecessors(s)}
        start = time.time()
        if self.buffer is not None and LLM_MODULE in stage.chunks:
            received = self._route_features(m, received)
        leaves = {p: self._leaves(p, stage, payload) for p, payload in received.items()}
        routed = self._routed(s)
        batch = self.inputs.encoder_batches[m] if routed else self.inputs.microbatches[m]
        keeps = not self.forward_only and self.plan.stages[s].runs_backward and not (routed and not self.routing.users[m])  # type: ignore
        kwargs = self.inputs.llm_kwargs[m] if batch is not None and not routed else {}
        if LLM_MODULE in stage.chunks and batch is not None:
            _check_cp_kwargs(kwargs, self.comm, s, m)
        with torch.set_grad_enabled(keeps), self.inputs.autocast(), self._counting(s):
            out = stage.forward(batch, leaves, self.inputs.loss_fn, kwargs)
        if keeps:
            self.records[(s, m)] = _Record(leaves, out)
            if routed:
                self.users_left[(s, m)] = set(self.routing.users[m])  # type: ignore[union-attr]
        if stage.is_last and out["llm"]:
            self.losses.append(out["llm"][0].detach())
        for t in self.plan.successors(s):
            self._give(("F", s, t, m), sent_payload(self.plan, s, t, out))  # a TP follower: nothing into the LLM
        self.events.append(TimelineEvent(self.comm.pp_rank, "F", s, m, start, time.time(), self.mhz))

    def _route_features(self, j: int, received: dict[int, Any]) -> dict[int, Any]:
        """The first LLM stage under a routing: hold each encoder predecessor's features of encoder microbatch
        ``j`` and replace them by LLM microbatch ``j``'s (``[rows, hidden]`` per branch, ``requires_grad`` when a
        source had a graph; ``[]`` when none of its samples has that branch)."""
        assert self.buffer is not None
        out = dict(received)
        encoders = [p for p in received if not self.plan.stages[p].is_llm]
        for p in encoders:
            payload = received[p]
            self.buffer.hold(j, {m: ts[0] if ts else None for m, ts in payload.items()}, source=p)
            with torch.no_grad():
                feats = self.buffer.gather(j, payload, source=p)
            out[p] = {m: [feats[m].detach().requires_grad_(self._source_grad(p, j, m))] if m in feats else []
                      for m in payload}
        if encoders:
            self.buffer.release(j)
        return out

    def _source_grad(self, p: int, j: int, branch: str) -> bool:
        """Whether some encoder microbatch feeding ``branch`` of LLM microbatch ``j`` sent features with a graph."""
        assert self.buffer is not None
        held = self.buffer.held
        return any(held[(p, i)][branch].requires_grad for i, _, _ in self.buffer.routing.spans(j, branch))

    def _leaves(self, p: int, stage: PipelineStage, payload: Mapping[str, list]) -> Payload:
        """Received tensors as fresh graph leaves. One requires a gradient when its sender stage runs backward
        and had a graph for it this microbatch (``requires_grad`` travels with the tensor), and the chunk that
        consumes it records a graph."""
        grad = self.plan.stages[p].runs_backward
        out: Payload = {}
        for module, tensors in payload.items():
            wants = grad and stage.module_runs_grad(module if module in stage.chunks else "llm")
            out[module] = [t.detach().requires_grad_(wants and t.requires_grad and t.is_floating_point())
                           for t in tensors]
        return out

    def _counting(self, s: int) -> AbstractContextManager:
        if not self.inputs.instrument:
            return nullcontext()

        def pack(t: torch.Tensor) -> torch.Tensor:
            self.saved[s] += 1
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    # -- backward
    def _backward(self, action: Action) -> None:
        s, m = action.stage, action.microbatch
        record = self.records[(s, m)]
        if record.out_grads is None:
            record.out_grads = self._output_grads(s, m, record)
        start = time.time()
        with self.inputs.autocast():
            if action.kind == "W":
                ran = weight_gradients(record.kept) if record.kept is not None else False
            elif self.schedule.split_backward:
                ran, record.kept = self._input_grads(s, record, record.out_grads)
            else:
                ran = self._fused_backward(record.out_grads, retain=False)
        self.backwards[s] += int(ran)
        if action.kind == "B":
            for p in self.plan.predecessors(s):
                if self.plan.stages[p].runs_backward:  # a TP follower gets the gradient of its leader's features
                    self._give(("B", s, p, m), _input_grad_payload(record.inputs[gradient_source(self.plan, p, s)]))
        if frees_activations(self.plan, action, self.schedule.split_backward):
            del self.records[(s, m)]
        self.events.append(TimelineEvent(self.comm.pp_rank, action.kind, s, m, start, time.time(), self.mhz))

    def _output_grads(self, s: int, m: int, record: _Record) -> _Pairs:
        """``(output, gradient)`` pairs to backpropagate (the scaled loss on the last stage)."""
        if self.stages.stages[s].is_last:
            if not record.outputs["llm"]:
                return []  # an LLM microbatch without samples (all deferred)
            loss = record.outputs["llm"][0]
            return [(loss, torch.full_like(loss, self.inputs.scale))] if loss.requires_grad else []
        (t,) = self.plan.successors(s)
        grads = self._take(("B", t, s, m))
        pairs = []
        for module, outs in record.outputs.items():
            for out, grad in zip(outs, grads.get(module, [])):
                if grad is not None and out.requires_grad:
                    pairs.append((out, grad))
        return pairs

    def _fused_backward(self, pairs: _Pairs, retain: bool) -> bool:
        if not pairs:
            return False
        outs, grads = zip(*pairs)
        torch.autograd.backward(list(outs), list(grads), retain_graph=retain)
        return True

    def _input_grads(self, s: int, record: _Record, pairs: _Pairs) -> tuple[bool, WeightGradients | None]:
        """``B`` of a split backward (:func:`~plait.parallel.pipeline.split_backward.input_gradients`): the input
        gradients into the leaves' ``.grad``; returns whether it back-propagated and what ``W`` needs."""
        if not pairs:
            return False, None
        leaves = [t for payload in record.inputs.values() for lst in payload.values() for t in lst if t.requires_grad]
        params = [p for p in self.stages.stages[s].params if p.requires_grad]
        found, kept = input_gradients(pairs, leaves, params)
        for leaf, grad in zip(leaves, found):
            leaf.grad = grad
        return bool(leaves), kept

    # -- backward of an encoder stage under a FeatureRouting
    def _backward_routed(self, action: Action) -> None:
        """``B``/``W`` of encoder stage ``s`` for LLM microbatch ``j`` under a :class:`FeatureRouting`.

        The output gradients that arrive for ``j`` belong to ``j``'s samples, whose activations live in the
        records of their encoder microbatches ``routing.sources[j]``: each such record is back-propagated with
        its share (linearity: the shares of all its LLM microbatches sum to its whole output gradient), its graph
        retained while another LLM microbatch still has to bring gradients for it. The input gradients sent
        upstream are, per record in ``sources[j]`` order, that record's partial input gradients.
        """
        s, j = action.stage, action.microbatch
        routing = self.routing
        assert routing is not None  # _routed(s)
        if (s, j) not in self.shares:
            self.shares[(s, j)] = self._routed_output_grads(s, j)
        last = frees_activations(self.plan, action, self.schedule.split_backward)
        start, ran = time.time(), False
        with self.inputs.autocast():
            for i, pairs in self.shares[(s, j)].items():
                record = self.records[(s, i)]
                retain = not last or bool(self.users_left[(s, i)] - {j})
                if action.kind == "W":
                    kept = self.kept.pop((s, i, j), None)
                    ran |= weight_gradients(kept, retain) if kept is not None else False
                    continue
                _clear_leaf_grads(record)  # the leaves' grads must be this j's share only
                if self.schedule.split_backward:
                    done, self.kept[(s, i, j)] = self._input_grads(s, record, pairs)
                    ran |= done
                else:
                    ran |= self._fused_backward(pairs, retain)
        self.backwards[s] += int(ran)
        if action.kind == "B":
            self._send_routed_input_grads(s, j)
        if last:
            del self.shares[(s, j)]
            for i in routing.sources[j]:
                self.users_left[(s, i)].discard(j)
                if not self.users_left[(s, i)]:
                    del self.records[(s, i)], self.users_left[(s, i)]
        self.events.append(TimelineEvent(self.comm.pp_rank, action.kind, s, j, start, time.time(), self.mhz))

    def _routed_output_grads(self, s: int, j: int) -> dict[int, _Pairs]:
        """Per encoder microbatch ``i`` of ``routing.sources[j]``, the ``(output, gradient)`` pairs of its record
        that LLM microbatch ``j``'s gradient message covers."""
        routing = self.routing
        assert routing is not None
        (t,) = self.plan.successors(s)
        grads = self._take(("B", t, s, j))
        shares: dict[int, _Pairs] = {i: [] for i in routing.sources[j]}
        for module, tensors in grads.items():
            if self.plan.stages[t].is_llm:
                if tensors and tensors[0] is not None:
                    outputs = split_feature_grad(routing, j, module, tensors[0],
                                                 lambda i, m=module: self.records[(s, i)].outputs[m][0])
                    for i, g in outputs.items():
                        shares[i].append((self.records[(s, i)].outputs[module][0], g))
                continue
            pos = 0
            for i in routing.sources[j]:
                outs = self.records[(s, i)].outputs.get(module, [])
                for out, grad in zip(outs, tensors[pos : pos + len(outs)]):
                    if grad is not None and out.requires_grad:
                        shares[i].append((out, grad))
                pos += len(outs)
        return shares

    def _send_routed_input_grads(self, s: int, j: int) -> None:
        """Per predecessor that runs backward: per module, the input gradients of the records of
        ``routing.sources[j]``, concatenated in that order (the receiver splits them by its own records)."""
        routing = self.routing
        assert routing is not None
        for p in self.plan.predecessors(s):
            if not self.plan.stages[p].runs_backward:
                continue
            payload: dict[str, list[torch.Tensor | None]] = defaultdict(list)
            for i in routing.sources[j]:
                for module, grads in _input_grad_payload(self.records[(s, i)].inputs[p]).items():
                    payload[module] += grads
            self._give(("B", s, p, j), dict(payload))


def _clear_leaf_grads(record: _Record) -> None:
    for payload in record.inputs.values():
        for tensors in payload.values():
            for t in tensors:
                t.grad = None


def _check_cp_kwargs(kwargs: Mapping[str, Any], comm: PipelineComm, s: int, m: int) -> None:
    """An LLM stage under context parallelism needs this rank's ``plait_cp`` shard over ``comm.cp_group``:
    without it every CP rank would run all tokens and the gradient sum over CP would count them ``cp`` times."""
    shard = kwargs.get("plait_cp")
    cp = 1 if shard is None else shard.cp
    if cp != comm.cp_size or (shard is not None and shard.rank != comm.cp_rank):
        got = "no plait_cp shard" if shard is None else f"a plait_cp shard of rank {shard.rank} of cp={cp}"
        raise ValueError(f"LLM stage {s}, microbatch {m}: llm_kwargs gave {got}, but this rank is CP rank "
                         f"{comm.cp_rank} of cp={comm.cp_size}")


def _input_grad_payload(inputs: Payload) -> dict[str, list[torch.Tensor | None]]:
    return {m: [t.grad if t.requires_grad else None for t in lst] for m, lst in inputs.items()}
