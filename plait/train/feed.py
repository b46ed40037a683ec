"""The trainer's side of lazy loading: which samples this rank needs in each coming step, and the ranks'
agreement on the samples that failed to load.

Every rank plans every step from metadata alone (no communication), so it knows ahead which samples its DP
replica trains in each coming step; a :class:`~plait.data.loader.SampleFeed` loads them in worker processes,
steps ahead (:func:`upcoming_rank_samples`). A sample that passed the metadata pass can still fail to decode
(pixels that do not decode behind a readable header, a file changed since): that rank alone knows it. Before
the step, :func:`agree_on_failures` makes the failed positions of the global batch known to every rank (an
all-reduce of a per-position flag, and only when some flag is set, the messages with ``all_gather_object``), so
every rank drops the same samples and plans the same step without them; the step's loss normalisation then
counts only the target tokens of the samples trained.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.data.loader import GlobalBatchLoader, LoadedSamples, MultimodalDataset
from plait.data.metadata import SkippedSample
from plait.data.sources import SampleError

__all__ = ["StepSamples", "agree_on_failures", "receive_step", "upcoming_rank_samples"]

log = logging.getLogger(__name__)


def upcoming_rank_samples(loader: GlobalBatchLoader, start: int, end: int,
                          rank_samples: Callable[[Sequence[int], int], Sequence[int]]) -> Iterator[tuple[int, ...]]:
    """For steps ``start .. end - 1``: the dataset indices this rank needs, ``rank_samples(global batch, step)``
    (sorted), the global batches drawn from a copy of ``loader`` (its position is left as it is)."""
    ahead = copy.deepcopy(loader)  # the same kind of loader (a mixture's too) at the same position
    for step in range(start, end):
        yield tuple(sorted(rank_samples(ahead.next_batch(), step)))


def agree_on_failures(indices: Sequence[int], loaded: LoadedSamples, device: torch.device) -> dict[int, str]:
    """``{position in indices: error message}`` of the samples of the global batch ``indices`` that failed to
    load on any rank; the same dict on every rank (collective when distributed: one all-reduce of ``[B]``
    flags, plus an ``all_gather_object`` of the messages when a flag is set)."""
    mine = {k: loaded.failed[i] for k, i in enumerate(indices) if i in loaded.failed}
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return mine
    flags = torch.zeros(len(indices), dtype=torch.int32, device=device)
    if mine:
        flags[list(mine)] = 1
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if not bool(flags.any()):
        return {}
    every: list[dict[int, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged = {k: v for d in every for k, v in (d or {}).items()}
    return dict(sorted(merged.items()))


@dataclass
class StepSamples:
    """A step's global batch after the ranks agreed on its failures.

    Attributes:
        indices: the dataset indices trained (failed ones dropped, order kept).
        samples: the processed samples this rank loaded ahead (by dataset index).
        dropped: the samples dropped from the step (id, ``file:line``, reason).
        wait_s: seconds the step waited for its samples.
    """

    indices: list[int]
    samples: dict[int, object]
    dropped: list[SkippedSample]
    wait_s: float


def receive_step(loaded: LoadedSamples, indices: Sequence[int], dataset: MultimodalDataset, device: torch.device,
                 on_error: str, step: int) -> StepSamples:
    """The step's :class:`StepSamples` from what this rank loaded (collective when distributed:
    :func:`agree_on_failures`). Each dropped sample is logged with its id, file and line.

    Raises:
        SampleError: with ``on_error = "raise"`` when a sample failed to load (its message: record id, file and
            line, and why), on every rank alike; or when every sample of the step failed.
    """
    failed = agree_on_failures(indices, loaded, device)
    dropped = [SkippedSample(dataset.sample_meta(indices[k]).id, dataset.where(indices[k]), msg)
               for k, msg in failed.items()]
    if dropped and on_error == "raise":
        raise SampleError(f"step {step}: {dropped[0].reason}")
    for s in dropped:
        log.warning("step %d: dropping sample %r (%s) that failed to load: %s", step, s.id, s.source, s.reason)
    kept = [i for k, i in enumerate(indices) if k not in failed]
    if not kept:
        raise SampleError(f"step {step}: every sample of the global batch failed to load, e.g. {dropped[0].reason}")
    return StepSamples(kept, dict(loaded.samples), dropped, loaded.wait_s)
