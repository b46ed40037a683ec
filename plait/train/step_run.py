"""One rank's forward/backward of its planned microbatches (deferral included) for a model trained whole on every
rank: the flat step runner (:class:`FlatRunner`) of :class:`~plait.train.trainer.Trainer`.

:func:`run_microbatches` runs encoder microbatch ``i`` just before LLM microbatch ``i`` (planned order). Encoder
outputs enter the LLM microbatches as detached leaves, assembled by the one deferral implementation
(:class:`~plait.parallel.deferral.FeatureBuffer`); once every LLM microbatch that reads them has run backward,
the gradients accumulated on the leaves go back through the encoder graph (detached-leaf re-injection).

Under FSDP2 (:mod:`plait.parallel.fsdp`) every rank must run the same sequence of forwards and backwards through
the sharded groups, whatever its share of the batch holds. :class:`Uniform` makes it so:

- every LLM microbatch runs on every rank when the LLM is sharded (an empty one on a dummy batch whose loss is
  multiplied by 0), every sharded encoder branch that some rank uses in the step runs in every encoder
  microbatch (on a dummy item, its backward fed zeros, when the share has no item of that modality), branch by
  branch in model order, with the same number of encoder calls on every rank (images of several sizes take one
  call per size: the ranks with fewer add calls on a dummy item, joined to the features with weight 0,
  :func:`encode_padded`);
- a branch that no rank uses in the step (no item of its modality in the global batch) runs nowhere: its
  parameters keep no gradient (``None``), so AdamW neither decays nor steps them, as in one process and under DP
  (whose reducer keeps a used-flag per parameter);
- encoder microbatch ``i``'s backward runs after LLM microbatch ``r[i]``, ``r[i]`` the latest of every rank's
  last reader of ``i`` (one all-reduce MAX of ``M`` integers per step): the same point on every rank;
- gradients accumulate unsharded until each module's last backward of the step, whose reduce-scatter then
  overlaps the remaining backwards (``set_requires_gradient_sync``): one reduction per step.

The dummy work adds exact zeros, so gradients equal one process's, and a parameter gets a gradient exactly when it
would in one process (at the granularity of a branch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from plait.data.collate import Batch
from plait.data.processing import SampleMeta
from plait.models.generation import stop_token_ids
from plait.models.hf import dummy_encoder_input
from plait.parallel.deferral import FeatureBuffer
from plait.parallel.fsdp import ShardedModel
from plait.planner.types import LLM_MODULE
from plait.train.batches import StepBatches
from plait.train.evaluation import EvalSide

__all__ = ["FlatRunner", "Uniform", "agreed_schedule", "dummy_llm_batch", "encode_padded", "encoder_calls", "run_microbatches",
           "run_uniform_microbatches", "unused_branches"]

Encode = Callable[[str, Batch | None, int], torch.Tensor]
"""``(branch, encoder batch or None for a dummy item, encoder calls)`` -> projected features ``[rows, hidden]``
(:func:`encode_padded`)."""
LlmLoss = Callable[[int, Batch | None, dict[str, torch.Tensor]], torch.Tensor]
"""``(LLM microbatch, batch or None for a dummy, features)`` -> loss sum of its tokens (float scalar)."""


@dataclass(frozen=True)
class Uniform:
    """What makes every rank's step run the same collectives under FSDP2 (module docstring).

    Attributes:
        sharded: the model's FSDP2 groups.
        branches: encoder branches in model order.
        calls: ``(branch, encoder batch)`` -> the encoder calls its items take (:func:`encoder_calls`).
        group: the process group over which the ranks' shares differ (None: all ranks).
    """

    sharded: ShardedModel
    branches: Sequence[str]
    calls: Callable[[str, Batch], int]
    group: Any = None


def agreed_schedule(step: StepBatches, uniform: Uniform) -> tuple[list[int], list[list[int]]]:
    """What every rank of ``uniform.group`` runs alike: per encoder microbatch ``i``, the LLM microbatch after which
    ``i``'s backward runs (the latest over the ranks of the last LLM microbatch reading it; itself when nothing
    reads it), and per encoder microbatch and branch the encoder calls (the most over the ranks; at least 1 for a
    sharded branch that some rank uses in some microbatch of the step, 0 in every microbatch for one that no rank
    uses: it then runs nowhere and its parameters keep no gradient). One all-reduce MAX. Collective."""
    routing, n, k = step.routing, step.routing.num_microbatches, len(uniform.branches)
    last = [max((i, *users)) for i, users in enumerate(routing.users)]
    calls = [[uniform.calls(b, batch) if batch is not None and b in batch.modality_inputs else 0
              for b in uniform.branches] for batch in step.encoder_batches]
    flat = torch.tensor(last + [c for row in calls for c in row], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=uniform.group)
    agreed = [int(x) for x in flat]
    rows = [agreed[n + j * k: n + (j + 1) * k] for j in range(n)]
    least = [int(uniform.sharded.sharded(b) and any(row[m] for row in rows)) for m, b in enumerate(uniform.branches)]
    return agreed[:n], [[max(c, low) for c, low in zip(row, least)] for row in rows]


def run_microbatches(step: StepBatches, scale: float, encode: Callable[[Batch], dict[str, torch.Tensor]],
                     loss: LlmLoss) -> tuple[torch.Tensor, int]:
    """Forward/backward of this rank's encoder and LLM microbatches in planned order, each LLM loss sum times
    ``scale`` (module docstring). Returns (this rank's loss sum (float64 scalar), peak bytes of encoder outputs
    kept across a microbatch boundary).

    Raises:
        RuntimeError: when an encoder microbatch is never consumed (an invalid plan).
    """
    buffer = FeatureBuffer(step.routing)
    encoded: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}  # outputs, their leaves
    loss_sum = torch.zeros((), dtype=torch.float64)
    for j in range(step.routing.num_microbatches):
        if step.encoder_batches[j] is not None:
            outputs = encode(step.encoder_batches[j])
            encoded[j] = outputs, _leaves(outputs)
            buffer.hold(j, encoded[j][1])
        batch = step.llm_batches[j]
        if batch is not None:
            mb_loss = loss(j, batch, buffer.gather(j))
            if mb_loss.requires_grad:  # e.g. a text-only microbatch under a frozen LLM has no gradient
                (mb_loss * scale).backward()
            loss_sum += mb_loss.detach().double().cpu()
        for i in buffer.release(j):
            _backward_through(*encoded.pop(i))
    if encoded:
        raise RuntimeError(f"encoder microbatches {sorted(encoded)} were never consumed (invalid plan)")
    return loss_sum, buffer.peak


def run_uniform_microbatches(step: StepBatches, scale: float, encode: Encode, loss: LlmLoss,
                             uniform: Uniform) -> tuple[torch.Tensor, int]:
    """:func:`run_microbatches` with every rank running the same collectives (:class:`Uniform`, module docstring).
    Collective over every rank of the FSDP2 groups."""
    routing, sharded = step.routing, uniform.sharded
    release, calls = agreed_schedule(step, uniform)
    n = routing.num_microbatches
    last_encoder = max(range(n), key=lambda i: (release[i], i)) if n else -1
    sharded.set_gradient_sync(False)
    buffer = FeatureBuffer(routing)
    encoded: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
    loss_sum = torch.zeros((), dtype=torch.float64)
    try:
        for j in range(n):
            encoded[j] = _encode_all(step.encoder_batches[j], encode, uniform, calls[j])
            buffer.hold(j, {b: encoded[j][1][b] for b in encoded[j][1] if not b.startswith("~")})
            sharded.set_gradient_sync(j == n - 1, LLM_MODULE)
            loss_sum += _llm_microbatch(j, step.llm_batches[j], buffer.gather(j), loss, scale, sharded)
            buffer.release(j)
            for i in [i for i in sorted(encoded) if release[i] == j]:
                for b in uniform.branches:
                    sharded.set_gradient_sync(i == last_encoder, b)
                _backward_each(*encoded.pop(i), uniform.branches)
    finally:
        sharded.set_gradient_sync(True)
    if encoded:
        raise RuntimeError(f"encoder microbatches {sorted(encoded)} were never consumed (invalid plan)")
    return loss_sum, buffer.peak


def _encode_all(batch: Batch | None, encode: Encode, uniform: Uniform, calls: Sequence[int]
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Outputs and leaves of one encoder microbatch, branch by branch in model order with the agreed encoder
    ``calls``: real items where the batch has them, a dummy item (key ``"~<branch>"``: never held, never read)
    for a sharded branch where it has none and some rank uses the branch in the step (``calls`` > 0)."""
    outputs: dict[str, torch.Tensor] = {}
    present = batch.modality_inputs if batch is not None else {}
    for b, n in zip(uniform.branches, calls):
        if b in present:
            outputs[b] = encode(b, batch, n)
        elif n > 0 and uniform.sharded.sharded(b):
            outputs["~" + b] = encode(b, None, n)
    return outputs, _leaves(outputs)


def _llm_microbatch(j: int, batch: Batch | None, features: dict[str, torch.Tensor], loss: LlmLoss, scale: float,
                    sharded: ShardedModel) -> torch.Tensor:
    """Forward/backward of LLM microbatch ``j`` (a dummy one, loss times 0, when this rank has no sample in it and
    the LLM is sharded). Returns its loss sum (float64, 0 for a dummy)."""
    if batch is None and not sharded.sharded(LLM_MODULE):
        return torch.zeros((), dtype=torch.float64)
    mb_loss = loss(j, batch, features)
    weight = scale if batch is not None else 0.0
    if mb_loss.requires_grad:
        (mb_loss * weight).backward()
    return mb_loss.detach().double().cpu() if batch is not None else torch.zeros((), dtype=torch.float64)


def _leaves(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: o.detach().requires_grad_(o.requires_grad) for n, o in outputs.items()}


def _backward_through(outputs: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor]) -> None:
    """Propagate the gradients accumulated on the detached ``leaves`` through the encoder graph of ``outputs``
    (one backward for all branches); a branch whose leaf got no gradient (frozen, or no local token on this CP
    rank) is skipped."""
    pairs = [(o, leaves[n].grad) for n, o in outputs.items() if o.requires_grad and leaves[n].grad is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _backward_each(outputs: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor],
                   branches: Sequence[str]) -> None:
    """One backward per branch with a graph, in model order (the same sequence of groups on every rank): the
    gradient gathered on its leaf, zeros for a dummy item or a leaf that got none."""
    for b in branches:
        for key in (b, "~" + b):
            out = outputs.get(key)
            if out is not None and out.requires_grad:
                grad = leaves[key].grad
                out.backward(grad if grad is not None and key == b else torch.zeros_like(out))


def unused_branches(sharded: ShardedModel, metas: Sequence[SampleMeta]) -> list[str]:
    """The encoder branches with FSDP2 groups in ``sharded`` that no sample of a global batch (``metas``: every
    sample's metadata, known to every rank) uses: no item of their modality. Under pipeline parallelism their
    reduction still gives them zeros; ``ShardedModel.drop_gradients`` then leaves them no gradient, as in one
    process."""
    used = {name for meta in metas for name, _ in meta.items}
    return [m for m in sharded.groups if m != LLM_MODULE and m not in used]


def encoder_calls(model: Any, name: str, batch: Batch) -> int:
    """Encoder calls of branch ``name`` of ``model`` (a ``MultimodalModel``) on ``batch``'s items: one per image
    size (``ModalityEncoder.item_groups``) when the encoder trains, else 1 (a frozen encoder is not sharded: its
    calls run no collective)."""
    branch = model.encoders[name]
    if not any(p.requires_grad for p in branch.encoder.parameters()):
        return 1
    return len(branch.item_groups(batch.modality_inputs[name]))


def encode_padded(model: Any, name: str, inputs: dict[str, Any] | None, calls: int,
                  device: torch.device) -> torch.Tensor:
    """Projected features ``[rows, hidden]`` of branch ``name`` of ``model`` on ``inputs`` (None: one all-zero
    item of the encoder's native shape, ``plait.models.hf.dummy_encoder_input``), with ``calls`` encoder calls in
    all: the calls its items take, then calls on the dummy item whose features join with weight 0 (the same
    sharded groups run, in the same order, on every rank; their gradient is zero). The encoder runs under
    ``no_grad`` when frozen, as ``MultimodalModel.encode``."""
    branch = model.encoders[name]
    trains = any(p.requires_grad for p in branch.encoder.parameters())
    own = len(branch.item_groups(inputs)) if inputs is not None and trains else int(inputs is not None)
    with nullcontext() if trains else torch.no_grad():
        feats = branch.encoder_forward(inputs) if inputs is not None else None
        dummy = dummy_encoder_input(branch.encoder, branch.modality, device)
        pads = [branch.encoder_features(dummy).flatten(0, 1) for _ in range(max(0, calls - own))]
    if feats is None:
        feats, pads = pads[0], pads[1:]
    for pad in pads:
        feats = feats + 0 * pad.sum()
    return branch.projector(feats)


def dummy_llm_batch(pad_id: int, tokens: int, device: torch.device) -> Batch:
    """A one-row text batch of ``tokens`` padding-id tokens with no target (its loss is 0 but has a graph through
    every LLM unit): the LLM microbatch of a rank with no sample in it under FSDP2."""
    ids = torch.full((1, tokens), pad_id, dtype=torch.long, device=device)
    ones = torch.ones_like(ids)
    return Batch(ids, torch.full_like(ids, -100), ones, torch.arange(tokens, device=device)[None], 0 * ones,
                 -ones, {}, (SampleMeta("dummy", "", tokens, tokens, 0, ()),))


class FlatRunner:
    """The step and validation of a model trained whole on every rank (one process, DP x CP, TP, FSDP2): this rank's
    planned microbatches in order (:func:`run_microbatches`; :func:`run_uniform_microbatches` when the gradient sum
    needs every rank to run the same collectives), the gradients summed by the trainer's ``sync``
    (:mod:`plait.parallel.grad_sync`) once, after the deferred encoder backwards.

    Args:
        trainer: the :class:`~plait.train.trainer.Trainer` (its ``model``, ``sync``, the step's planning
            ``plan_batches`` and the loss ``microbatch_loss``).
    """

    def __init__(self, trainer: Any) -> None:
        self.t = trainer

    def forward_backward(self, indices: Sequence[int], plan: Any) -> tuple[float, int, int]:
        """Forward/backward this rank's share of the global batch ``indices`` by the microbatch ``plan`` (deferral
        included); the gradients, summed over all ranks and scaled by 1 / global target tokens, accumulate in
        ``.grad``. Returns ``(global loss, global target tokens, peak bytes of encoder outputs this rank kept
        across a microbatch boundary)``.

        Encoder microbatch ``i`` runs just before LLM microbatch ``i``; its outputs enter the LLM microbatches as
        detached leaves (:class:`~plait.parallel.deferral.FeatureBuffer`), whose gathered gradients go back through
        the encoders once every LLM microbatch reading them has run backward. The gradient sum is armed before the
        last LLM microbatch's backward (DP buckets of the LLM start during it) and finished after the deferred
        encoder backwards. A rank whose share is empty joins the sum with no gradient (zeros)."""
        t = self.t
        t.model.train()
        global_targets = sum(t.train_set.sample_meta(i).target_tokens for i in indices)
        batches = t.plan_batches(indices, plan)
        scale, sync = 1.0 / max(1, global_targets), t.sync
        sync.start()
        if sync.uniform:  # FSDP2: every rank runs the same collectives
            uniform = Uniform(sync.sharded, list(t.model.encoders), partial(encoder_calls, t.model))
            loss_sum, peak = run_uniform_microbatches(batches, scale, self._encode_branch, self._uniform_loss(batches),
                                                      uniform)
        else:
            last = max((j for j, b in enumerate(batches.llm_batches) if b is not None), default=-1)

            def loss(j: int, batch: Batch, features: dict[str, torch.Tensor]) -> torch.Tensor:
                if j == last:  # its backward is the last to reach the LLM's parameters
                    sync.arm()
                return t.microbatch_loss(batch, batches.llm_kwargs[j], features)

            loss_sum, peak = run_microbatches(batches, scale, self._encode, loss)
        sync.finish()
        sync.reduce_loss(loss_sum)
        return float(loss_sum) / max(1, global_targets), global_targets, peak

    def _encode_branch(self, name: str, batch: Batch | None, calls: int) -> torch.Tensor:
        """Projected features of branch ``name`` on ``batch``'s items, or on a dummy item (``batch`` None), in
        ``calls`` encoder calls (:func:`encode_padded`)."""
        inputs = batch.modality_inputs[name] if batch is not None else None
        with self.t.autocast():
            return encode_padded(self.t.model, name, inputs, calls, self.t.info.device)

    def _uniform_loss(self, step: StepBatches) -> LlmLoss:
        """The LLM loss of microbatch ``j`` of ``step``, or of a dummy batch (no target) when it is None."""
        t = self.t

        def loss(j: int, batch: Batch | None, features: dict[str, torch.Tensor]) -> torch.Tensor:
            if batch is None:
                batch = dummy_llm_batch(t.processor.pad_id, 2 * t.cp, t.info.device)
                return t.microbatch_loss(batch, t._llm_kwargs(batch), {})
            return t.microbatch_loss(batch, step.llm_kwargs[j], features)
        return loss

    def _encode(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Every encoder branch on the items of ``batch``: per branch, projected features ``[rows, hidden]``."""
        with self.t.autocast():
            return {name: self.t.model.encode(name, inputs) for name, inputs in batch.modality_inputs.items()}

    def eval_side(self) -> EvalSide:
        """This rank's part in an evaluation: the loss over the DP replicas (CP and TP rank 0 count it), answers
        over every rank but TP peers, which answer the same samples (generation runs the whole model, no CP)."""
        t = self.t
        stop = stop_token_ids(t.tokenizer, t.model.language_model.generation_config)
        tp, lead = t.dims.tp, t.dims.coords(t.info.rank).tp == 0  # TP peers run the same samples
        return EvalSide((t.dp, t.dp_rank), (t.info.world_size // tp, t.info.rank // tp), t.cp_rank == 0 and lead,
                        lead, 1,
                        lambda batches: [x for x in [t.microbatch_loss(b, t._llm_kwargs(b)) for b in batches] if lead],
                        lambda batches: [t.generate(b, stop) for b in batches])

    def train_mode(self, train: bool) -> None:
        """Evaluation runs the model in eval mode (no dropout); training mode again afterwards."""
        self.t.model.train(train)

    def after_fit(self, result: dict[str, Any]) -> None:
        """Nothing to add after the run."""

    def describe(self) -> str | None:
        """No setup line of its own."""
        return None
