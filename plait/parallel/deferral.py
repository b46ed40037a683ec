"""The one execution of a :class:`~plait.planner.microbatch.routing.FeatureRouting` (deferred encoder outputs), shared by the
non-pipeline trainer and the pipeline runtime's first LLM stage and encoder stages.

:class:`FeatureBuffer` keeps the features each encoder microbatch produced until the last LLM microbatch that
reads them, assembles each LLM microbatch's features (sample by sample, in placeholder order) and counts the
bytes held across a microbatch boundary. :func:`split_feature_grad` is the inverse for the backward: the
gradient of one LLM microbatch's features cut per sample and placed at the rows of its encoder microbatch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from plait.planner.microbatch.routing import FeatureRouting

__all__ = ["FeatureBuffer", "split_feature_grad"]


class FeatureBuffer:
    """Encoder features of a :class:`FeatureRouting`, kept per ``(source, encoder microbatch)`` until the last
    LLM microbatch reading them has been assembled (``source`` tells apart the pipeline stages that send
    features for the same microbatch; 0 when there is one).

    Attributes:
        routing: the plan executed.
        peak: the most bytes held after any :meth:`release` (features kept for later LLM microbatches).
    """

    def __init__(self, routing: FeatureRouting) -> None:
        self.routing = routing
        self.held: dict[tuple[int, int], Mapping[str, torch.Tensor]] = {}
        self.left = {i: set(users) for i, users in enumerate(routing.users)}
        self.peak = 0

    def hold(self, i: int, features: Mapping[str, torch.Tensor | None], source: int = 0) -> None:
        """Keep encoder microbatch ``i``'s ``features`` (per branch ``[rows, hidden]``; None or absent: no rows).

        Raises:
            ValueError: when a branch's rows differ from the routing's ``features`` of the microbatch's samples.
        """
        for branch, tensor in features.items():
            want, got = self.routing.encoder_rows(i, branch), 0 if tensor is None else int(tensor.shape[0])
            if got != want:
                raise ValueError(f"encoder microbatch {i} of stage {source}: branch {branch!r} produced {got} feature "
                                 f"rows but FeatureRouting.features gives its samples {want}")
        self.held[(source, i)] = {b: t for b, t in features.items() if t is not None}

    def gather(self, j: int, branches: Iterable[str] | None = None, source: int = 0) -> dict[str, torch.Tensor]:
        """Per branch (``branches``, default: those held), the features ``[rows, hidden]`` of LLM microbatch ``j``
        in placeholder order: slices of the held tensors (a graph through them when they have one); branches
        none of ``j``'s samples has are absent.

        Raises:
            RuntimeError: when a source encoder microbatch is not held (its forward has not run).
        """
        names = branches if branches is not None else sorted({b for (s, _), f in self.held.items() if s == source
                                                              for b in f})
        out: dict[str, torch.Tensor] = {}
        for branch in names:
            parts = []
            for i, start, stop in self.routing.spans(j, branch):
                if (source, i) not in self.held:
                    raise RuntimeError(f"LLM microbatch {j} reads encoder microbatch {i} of stage {source} before its "
                                       "forward: each stage's F must run in microbatch order")
                parts.append(self.held[(source, i)][branch][start:stop])
            if parts:
                out[branch] = torch.cat(parts) if len(parts) > 1 else parts[0]
        return out

    def release(self, j: int) -> list[int]:
        """After LLM microbatch ``j``: drop the encoder microbatches nobody reads any more and count the bytes
        still held (for later LLM microbatches). Returns the encoder microbatches dropped, ascending."""
        for i in self.routing.sources[j]:
            self.left[i].discard(j)
        dropped = sorted({i for _, i in self.held if not self.left[i]})
        for key in [k for k in self.held if k[1] in dropped]:
            del self.held[key]
        held = sum(t.numel() * t.element_size() for f in self.held.values() for t in f.values())
        self.peak = max(self.peak, held)
        return dropped


def split_feature_grad(routing: FeatureRouting, j: int, branch: str, grad: torch.Tensor,
                       output: Callable[[int], torch.Tensor]) -> dict[int, torch.Tensor]:
    """The gradient ``grad`` ``[rows, hidden]`` of LLM microbatch ``j``'s ``branch`` features (placeholder order)
    cut per sample, each piece placed at the sample's rows of its encoder microbatch ``i``: per such ``i`` whose
    ``output(i)`` (its features, ``[rows_i, hidden]``) has a graph, a tensor shaped like it (zeros elsewhere).

    Raises:
        RuntimeError: when ``grad``'s rows differ from the routing's rows of ``j``.
    """
    spans = routing.spans(j, branch)
    rows = sum(stop - start for _, start, stop in spans)
    if rows != grad.shape[0]:
        raise RuntimeError(f"LLM microbatch {j}: {grad.shape[0]} feature gradient rows for {branch!r}, the routing "
                           f"gives {rows}")
    full: dict[int, torch.Tensor] = {}
    offset = 0
    for i, start, stop in spans:
        out = output(i)
        if out.requires_grad:
            if i not in full:
                full[i] = torch.zeros_like(out)
            full[i][start:stop] = grad[offset : offset + stop - start]
        offset += stop - start
    return full
