"""Validation through one pipeline replica: forward-only passes of its stages for the loss and greedy answers,
the one implementation behind :class:`~plait.train.pipeline_trainer.PipelineTrainer` (a DP replica of one plan)
and ``plait launch``'s heterogeneous pipelines (:func:`replica_eval_side`).

The validation samples are shared over the replicas (pipelines) as over DP replicas; each pipeline computes the
teacher-forced loss of its share by forward-only passes (``run_pipeline_forward`` on a
:func:`~plait.planner.pipeline.schedules.forward_only` schedule of its plan) and answers its share of prompts by greedy
decoding through the same passes (:func:`~plait.train.evaluation.greedy_by_forward`, no KV cache): each pass's next
tokens come from the pipeline's last stage (with CP, the CP rank holding the last position) and are agreed on by
an all-reduce (max) over the pipeline's ranks. The pipeline's first rank counts the target tokens and keeps the
answers; ``evaluate_on`` then sums the losses over the job and scores the answers on rank 0 (collective over every
rank).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from plait.data.collate import Batch
from plait.parallel.pipeline.comm import PipelineComm
from plait.parallel.pipeline.step import run_pipeline_forward
from plait.parallel.stages import RankStages
from plait.planner.pipeline.types import PipelinePlan
from plait.planner.pipeline.schedule_ir import Schedule
from plait.planner.pipeline.schedules import forward_only
from plait.train.evaluation import EvalSide, greedy_by_forward, next_token_ids
from plait.train.loss import token_loss_sum

__all__ = ["PipelinePasses", "replica_eval_side"]


class PipelinePasses:
    """Forward-only passes of validation batches through one pipeline replica (module docstring).

    Args:
        stages, plan, comm: this rank's stages, its pipeline's plan and its :class:`PipelineComm`.
        group: the process group of the replica's ranks (pipeline x CP) that agree on each pass's next tokens;
            None for the default group (the replica is the whole job); False when the replica is one rank
            (nothing to agree on).
        autocast: context factory wrapped around every forward.
        llm_kwargs: per batch, extra keyword arguments of the LLM stages (``plait_mask``, ``plait_cp``), or None.
    """

    def __init__(self, stages: RankStages, plan: PipelinePlan, comm: PipelineComm, group: Any = False,
                 autocast: Callable[[], AbstractContextManager] = nullcontext,
                 llm_kwargs: Callable[[Batch], Mapping[str, Any]] | None = None) -> None:
        self.stages, self.plan, self.comm, self.group = stages, plan, comm, group
        self.autocast, self.llm_kwargs = autocast, llm_kwargs
        self._schedules: dict[int, Schedule] = {}

    def forward(self, batches: list[Batch], output_fn: Any) -> list[torch.Tensor]:
        """One forward-only pass of ``batches`` (collective over the pipeline): the last stage's ``output_fn`` per
        batch on its ranks, ``[]`` elsewhere. Schedules are built once per batch count."""
        if len(batches) not in self._schedules:
            self._schedules[len(batches)] = forward_only(self.plan, len(batches))
        kwargs = [self.llm_kwargs(b) for b in batches] if self.llm_kwargs is not None else None
        return run_pipeline_forward(self.stages, self._schedules[len(batches)], batches, self.comm,
                                    output_fn=output_fn, autocast=self.autocast, llm_kwargs=kwargs)

    def next_tokens(self, batches: list[Batch]) -> list[torch.Tensor]:
        """Each row's greedy next token ``[rows_i]`` per batch (CPU), on every rank of the replica: the last
        stage's argmax, agreed on by an all-reduce (max) where the others hold -1."""
        rows = [b.input_ids.shape[0] for b in batches]
        outs = self.forward(batches, next_token_ids)
        tokens = torch.cat(outs) if outs else torch.full((sum(rows),), -1, dtype=torch.long)
        tokens = tokens.to(self.comm.device)
        if self.group is not False:
            dist.all_reduce(tokens, op=dist.ReduceOp.MAX, group=self.group)
        return list(tokens.cpu().split(rows))

    def answers(self, batches: list[Batch], tokenizer: Any, stop_ids: Sequence[int], max_new_tokens: int,
                pad_id: int) -> list[list[str]]:
        """Greedy answers (decoded text per row, per batch) to left-padded prompt batches by repeated passes
        (:func:`~plait.train.evaluation.greedy_by_forward`; cost in :mod:`plait.train.evaluation`)."""
        new = greedy_by_forward(self.next_tokens, batches, list(stop_ids), max_new_tokens, pad_id)
        return [tokenizer.batch_decode(t, skip_special_tokens=True) for t in new]


def replica_eval_side(stages: RankStages, plan: PipelinePlan, comm: PipelineComm, replicas: tuple[int, int],
                      group: Any, tokenizer: Any, stop_ids: Sequence[int], max_new_tokens: int,
                      pad_id: int) -> EvalSide:
    """This rank's part in a validation through its pipeline among ``plait launch``'s pipelines (module docstring).

    Args:
        stages, plan, comm: this rank's stages, its pipeline's plan and its :class:`PipelineComm`.
        replicas: ``(pipelines, this pipeline's index)``: how the validation samples are shared.
        group: the process group of this pipeline's ranks (the next-token agreement), or None for a one-rank
            pipeline.
        tokenizer, stop_ids, max_new_tokens, pad_id: greedy decoding (answers decoded to text).
    """
    passes = PipelinePasses(stages, plan, comm, False if group is None else group)
    first = comm.pp_rank == 0
    return EvalSide(replicas, replicas, first, first, max(2 * len(comm.pp_ranks), 1),
                    lambda batches: passes.forward(batches, token_loss_sum),
                    lambda batches: passes.answers(batches, tokenizer, stop_ids, max_new_tokens, pad_id))
