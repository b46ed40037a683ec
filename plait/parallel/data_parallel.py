"""Data parallelism over the ``dp`` (and ``cp``) ranks: a DDP wrapper that makes every rank start from rank 0's
parameters, and the one gradient all-reduce both trainers use (gloo on CPU, NCCL on GPU): :func:`sum_gradients`
after the last backward, or a :class:`GradientReducer` whose buckets start during the last backward.

Buckets (the source is PyTorch DDP's reducer, Li et al., "PyTorch Distributed", VLDB 2020: fixed buckets in reverse
parameter order, each all-reduced asynchronously as soon as its gradients are final, all awaited before the
optimizer): every rank cuts the same parameters into the same buckets, and each bucket carries one flag per
parameter (1 where this rank has a gradient) after its gradients, so "which parameters got a gradient anywhere"
needs no collective of its own: a parameter without a gradient on every rank keeps ``grad=None`` (as in one
process: the optimizer skips it); one with a gradient on some rank gets the sum (zeros where it was unused).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from plait.parallel.process_group import DistInfo

__all__ = ["apply_data_parallel", "unwrap", "sum_gradients", "BUCKET_ELEMENTS", "GradientReducer",
           "OVERLAP_BUCKET_ELEMENTS"]

BUCKET_ELEMENTS = 1 << 24
"""Elements per all-reduce bucket of :func:`sum_gradients` (bounds its temporary flat buffer)."""
OVERLAP_BUCKET_ELEMENTS = 25 * (1 << 18)
"""Elements per bucket of a :class:`GradientReducer` in the trainer: 25 MiB of float32, DDP's default
``bucket_cap_mb``. On the 2-core CPU demo (6 MB of gradients: one LLM bucket, one encoder bucket) it measured 0.96
of ideal 2-process scaling against 0.90 with 2 MiB buckets (``bench/dp_scaling.py``): gloo's reduction runs on the
cores the backward uses, so smaller buckets add collectives without hiding any."""


def sum_gradients(params: Sequence[nn.Parameter], group: Any = None, bucket_elements: int = BUCKET_ELEMENTS) -> None:
    """Sum ``.grad`` of ``params`` over the ranks of ``group`` (default: all ranks), in place (module docstring:
    ``None`` where no rank has a gradient, zeros where this rank has none). One all-reduce per bucket: a run of
    parameters of one dtype and device of at most ``bucket_elements`` elements (a larger parameter alone),
    flattened with their flags (on the gradients' device). Collective over ``group``:
    every rank passes the same parameters in the same order.
    """
    GradientReducer(params, group, bucket_elements).finish()


class GradientReducer:
    """Gradient sums over ``group`` whose buckets start during the last backward of a step (module docstring).

    Args:
        params: the parameters to reduce, the same on every rank in the same order; cut into buckets in reverse
            order (the backward's order), ``early`` ones first, of one dtype and device, at most ``bucket_elements``
            elements each (a larger parameter alone), a bucket never mixing ``early`` and other parameters.
        group: the process group (default: all ranks).
        early: parameters whose gradient is final when the backward after :meth:`arm` has accumulated it once
            (e.g. the LLM's: only LLM microbatch backwards reach them, not the deferred encoder backwards): a bucket
            of them starts as soon as all its parameters' gradients are accumulated in that backward
            (``register_post_accumulate_grad_hook``), if every bucket before it has started. The others start in
            :meth:`finish`, in order, so every rank starts the same collectives in the same order.
        views: keep one buffer per bucket for the reducer's life and let :meth:`prepare` make the gradients views
            of it, so the backward accumulates into the buckets (DDP's ``gradient_as_bucket_view``): the gradients
            live once, nothing is copied in or out. Otherwise each step flattens the gradients into new buffers and
            copies the sums back (in place where this rank has a gradient).

    Use: ``prepare()`` before the step's first backward (``views``), ``arm()`` just before the step's last backward
    that reaches ``early`` (a rank without one does not call it), then ``finish()`` after the step's last backward:
    it starts the remaining buckets, waits for all and leaves the sums in ``.grad``. :meth:`close` removes the hooks.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: Any = None, bucket_elements: int = BUCKET_ELEMENTS,
                 early: Collection[nn.Parameter] = (), views: bool = False) -> None:
        early_ids = {id(p) for p in early}
        self.group = group
        backward = list(params)[::-1]
        order = [p for p in backward if id(p) in early_ids] + [p for p in backward if id(p) not in early_ids]
        self.buckets = _buckets(order, bucket_elements, lambda p: id(p) in early_ids)
        self._early = [all(id(p) in early_ids for p in b) for b in self.buckets]
        self._sizes = [[p.numel() for p in b] + [len(b)] for b in self.buckets]  # gradients, then the flags
        self._flat = [torch.zeros(sum(n), dtype=b[0].dtype, device=b[0].device)
                      for b, n in zip(self.buckets, self._sizes)] if views else []
        self._bucket_of = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self._viewed = False  # this step's gradients are views of the buffers (prepare)
        self._seen: set[int] = set()  # parameters whose gradient this rank accumulated this step (views)
        self._pending: list[int] = []
        self._started: list[tuple[torch.Tensor, Any]] = []
        self._armed = False
        self._reset()
        self.started_early = 0
        """Buckets of the last :meth:`finish`'s step that had started before it (during the backward)."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated)
                       for b, e in zip(self.buckets, self._early) if e or views for p in b]

    def prepare(self) -> None:
        """Before the step's first backward (``views``): zero the buffers and make every parameter's ``.grad`` a
        view of its place in its bucket. Only when no parameter has a gradient (e.g. after
        ``zero_grad(set_to_none=True)``); otherwise, or without ``views``, this step copies."""
        self._seen.clear()
        self._viewed = bool(self._flat) and all(p.grad is None for b in self.buckets for p in b)
        if self._viewed:
            for bucket, flat, sizes in zip(self.buckets, self._flat, self._sizes):
                flat.zero_()
                for p, piece in zip(bucket, flat.split(sizes)):
                    p.grad = piece.view_as(p)

    def arm(self) -> None:
        """The next backward is the step's last that reaches the ``early`` parameters."""
        self._armed = True

    def _accumulated(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: note that ``p`` has a gradient; when armed, count ``p`` in its early bucket and
        start the buckets now ready, in order.

        Raises:
            RuntimeError: when ``p``'s bucket has already started (its gradient was not final: a misuse of
                :meth:`arm`).
        """
        self._seen.add(id(p))
        k = self._bucket_of[id(p)]
        if not self._armed or not self._early[k]:
            return
        if k < len(self._started):
            raise RuntimeError(f"a gradient of bucket {k} was accumulated after its all-reduce started: arm() must "
                               "come just before the last backward that reaches the early parameters")
        self._pending[k] -= 1
        while len(self._started) < len(self.buckets) and self._pending[len(self._started)] == 0:
            self._start(len(self._started))

    def _start(self, k: int) -> None:
        """Start bucket ``k``'s asynchronous all-reduce: its gradients (zeros where None) and flags, in its buffer
        (views: a gradient no longer a view of it is copied in) or flattened into a new one."""
        bucket = self.buckets[k]
        if self._viewed:
            flat = self._flat[k]
            pieces = flat.split(self._sizes[k])
            for p, piece in zip(bucket, pieces):
                if p.grad is None:
                    piece.zero_()
                elif p.grad.data_ptr() != piece.data_ptr():
                    piece.copy_(p.grad.reshape(-1))
            pieces[-1].copy_(torch.tensor([id(p) in self._seen for p in bucket], dtype=flat.dtype))
        else:
            flags = torch.tensor([p.grad is not None for p in bucket], dtype=bucket[0].dtype, device=bucket[0].device)
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket]
                             + [flags])
        self._started.append((flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def finish(self) -> None:
        """Start the buckets not started yet (in order), wait for every bucket and leave the sums in ``.grad``
        (views of the buffers, or copied back); then ready for the next step. Collective over ``group``."""
        self.started_early = len(self._started)
        while len(self._started) < len(self.buckets):
            self._start(len(self._started))
        for bucket, sizes, (flat, work) in zip(self.buckets, self._sizes, self._started):
            work.wait()
            pieces = flat.split(sizes)
            for p, piece, used in zip(bucket, pieces, pieces[-1].tolist()):
                if used == 0:
                    p.grad = None
                elif self._viewed:
                    p.grad = piece.view_as(p)
                elif p.grad is None:
                    p.grad = piece.view_as(p).clone()
                else:
                    p.grad.copy_(piece.view_as(p))
        self._reset()

    def _reset(self) -> None:
        """Ready for a step: no bucket started, each early bucket waiting for all its gradients, not armed, copying
        until :meth:`prepare`."""
        self._started = []
        self._pending = [len(b) if e else -1 for b, e in zip(self.buckets, self._early)]
        self._armed = self._viewed = False

    def close(self) -> None:
        """Remove the post-accumulate-grad hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _buckets(params: Sequence[nn.Parameter], limit: int, kind: Any = lambda p: None) -> list[list[nn.Parameter]]:
    """``params`` in order, cut into runs of one dtype/device/``kind(p)`` and at most ``limit`` elements."""
    out: list[list[nn.Parameter]] = []
    size, key = 0, None
    for p in params:
        k = (p.dtype, p.device, kind(p))
        if not out or k != key or size + p.numel() > limit:
            out.append([])
            size, key = 0, k
        out[-1].append(p)
        size += p.numel()
    return out


def apply_data_parallel(model: nn.Module, info: DistInfo) -> nn.Module:
    """Wrap ``model`` in DDP when there is more than one rank; otherwise return it unchanged.

    The trainer's forward passes bypass the wrapper (deferred encoder backwards run after DDP's reducer
    would have fired; gradients are summed by :func:`sum_gradients`): what it provides is the broadcast of
    rank 0's parameters and buffers at construction. ``find_unused_parameters=True`` keeps a forward through the
    wrapper valid when a rank's share holds no item of some modality.
    """
    if info.world_size == 1:
        return model
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=True)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (or the module itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
