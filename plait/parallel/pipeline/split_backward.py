"""A stage's backward in two parts, as zero-bubble schedules run it (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024, section 2): ``B`` computes the gradients of the stage's inputs only, ``W`` those of its weights later,
without running ``B``'s part again.

How (the method of ``torch.distributed.pipelining``'s ``stage_backward_input``/``stage_backward_weight``, written
for plait's stages): a weight meets the activations at the autograd nodes where its forward first combines with
something computed from the stage's inputs (the matmul of a linear layer, say): its *intermediates*. ``B``
back-propagates from the outputs to the inputs only (the engine then skips every weight-gradient output), and a
pre-hook on each intermediate keeps the gradient arriving there. ``W`` back-propagates from those kept gradients,
at the intermediates, to the weights: each intermediate runs once for its weight-side inputs, then the weight side
of the graph (nodes computed from weights alone, e.g. ``w.t()`` or a gain made of two weights) once from the
gradients summed there; no activation-side node runs again, and none is counted twice. Weights no intermediate reaches
(their stage's inputs need no gradient, e.g. pixels into the first encoder stage: its ``B`` has nothing to do) get
their gradients in ``W`` from the outputs, as one unsplit backward.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightGradients", "input_gradients", "weight_gradients"]

_Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Meeting:
    """An intermediate (a node where weights meet the activations), its inputs on the weights' side (``edges``:
    ``(node, input number)`` of its ``next_functions``) and the gradients ``B`` kept arriving at it."""

    node: Node
    edges: list[tuple[Node, int]]
    grads: tuple[torch.Tensor | None, ...] | None = None


@dataclass
class WeightGradients:
    """What ``W`` needs from ``B`` for one stage and microbatch: the intermediates with their kept gradients, the
    weights they reach (``params``), and the weights none reaches (``rest``: back-propagated from ``pairs``, the
    outputs and their gradients)."""

    meetings: list[_Meeting]
    params: list[torch.Tensor]
    rest: list[torch.Tensor]
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _node(t: torch.Tensor) -> Node | None:
    """``t``'s autograd node: its ``grad_fn``, or for a leaf its gradient accumulator (created through a view)."""
    if t.grad_fn is not None or not t.requires_grad:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _users(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For every node of the graph below ``roots``: the nodes that take its output (the reverse edges)."""
    users: dict[Node, list[Node]] = collections.defaultdict(list)
    queue, seen = collections.deque(roots), set(roots)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            users[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return users


def _downstream(starts: Sequence[Node], users: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], list[Node]]:
    """The nodes reached from ``starts`` along ``users`` (their forward consumers), not passing through ``stop``;
    and the nodes of ``stop`` met on the way, in the order met."""
    reached, met = set(starts), []
    queue = collections.deque(starts)
    while queue:
        for user in users.get(queue.popleft(), ()):
            if user in stop:
                if user not in met:
                    met.append(user)
            elif user not in reached:
                reached.add(user)
                queue.append(user)
    return reached, met


def _meetings(pairs: _Pairs, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
              ) -> tuple[list[_Meeting], list[torch.Tensor], list[torch.Tensor]]:
    """The intermediates of ``params`` in the graph from ``inputs`` to the outputs of ``pairs``, the weights that
    reach one and those that reach none."""
    users = _users([n for n in (_node(out) for out, _ in pairs) if n is not None])
    from_inputs, _ = _downstream([n for n in map(_node, inputs) if n is not None], users, set())
    weight_side: set[Node] = set()
    meeting_nodes: list[Node] = []
    reached_params, rest = [], []
    for param in params:
        side, met = _downstream([_node(param)], users, from_inputs)
        if not met:
            rest.append(param)
            continue
        reached_params.append(param)
        weight_side |= side
        meeting_nodes += [n for n in met if n not in meeting_nodes]
    meetings = [_Meeting(n, [(m, k) for m, k in n.next_functions if m is not None and m in weight_side])
                for n in meeting_nodes]
    return meetings, reached_params, rest


def input_gradients(pairs: _Pairs, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
                    ) -> tuple[tuple[torch.Tensor | None, ...], WeightGradients]:
    """``B``: the gradients of ``inputs`` (tensors requiring grad) from the outputs and output gradients ``pairs``
    (graph retained), keeping at each intermediate of ``params`` (the stage's trainable weights) the gradient
    ``W`` needs (module docstring). Returns the input gradients (None where an input is not reached) and what
    :func:`weight_gradients` takes."""
    if not (inputs and pairs):  # nothing to send upstream: W back-propagates the whole stage
        return tuple(None for _ in inputs), WeightGradients([], [], list(params), list(pairs))
    meetings, reached, rest = _meetings(pairs, inputs, params)
    handles = []
    for meeting in meetings:
        def keep(grad_outputs, meeting=meeting):
            meeting.grads = tuple(grad_outputs)

        handles.append(meeting.node.register_prehook(keep))
    try:
        outs, grads = zip(*pairs)
        found = torch.autograd.grad(list(outs), list(inputs), list(grads), retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return found, WeightGradients(meetings, reached, rest, list(pairs) if rest else [])


def weight_gradients(kept: WeightGradients, retain: bool = False) -> bool:
    """``W``: the gradients of the weights from what :func:`input_gradients` kept, added to their ``.grad``
    (``retain``: keep the graph for another backward through it). Each intermediate runs once, for its
    weight-side inputs only; then the weight side of the graph runs once from the gradients summed there (no
    activation-side node runs again), accumulating into ``.grad`` as any backward does (autograd's accumulation:
    in place from the second microbatch on, the first gradient taken without a copy where autograd holds the only
    reference). Returns whether a backward reached the weights."""
    at: dict[tuple[Node, int], torch.Tensor] = {}
    for meeting in kept.meetings:
        given = [(i, g) for i, g in enumerate(meeting.grads or ()) if g is not None]
        if not (given and meeting.edges):
            continue
        found = torch.autograd.grad([GradientEdge(meeting.node, i) for i, _ in given],
                                    [GradientEdge(m, k) for m, k in meeting.edges], [g for _, g in given],
                                    retain_graph=retain, allow_unused=True)
        for edge, grad in zip(meeting.edges, found):
            if grad is not None:
                at[edge] = at[edge] + grad if edge in at else grad
    ran = bool(at)
    if at:  # an edge may be a weight's own accumulator (the intermediate takes the weight itself)
        torch.autograd.backward([GradientEdge(m, k) for m, k in at], list(at.values()), retain_graph=retain,
                                inputs=kept.params)
    if kept.rest and kept.pairs:
        outs, grads = zip(*kept.pairs)
        torch.autograd.backward(list(outs), list(grads), retain_graph=retain, inputs=kept.rest)
        ran = True
    return ran
