"""Validation through one pipeline replica among several (``plait launch``'s heterogeneous pipelines): this rank's
:class:`~plait.train.evaluation.EvalSide`, for :func:`~plait.train.evaluation.evaluate_on`.

The validation samples are shared over the replicas (pipelines) as over DP replicas; each pipeline computes the
teacher-forced loss of its share by forward-only passes (``run_pipeline_forward`` on a
:func:`~plait.planner.schedules.forward_only` schedule of its plan) and answers its share of prompts by greedy
decoding through the same passes (:func:`~plait.train.evaluation.greedy_by_forward`, no KV cache): each pass's next
tokens come from the pipeline's last stage and are agreed on by an all-reduce (max) over the pipeline's ranks. The
pipeline's first rank counts the target tokens and keeps the answers; ``evaluate_on`` then sums the losses over the
job and scores the answers on rank 0 (collective over every rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from plait.data.collate import Batch
from plait.parallel.pipeline.comm import PipelineComm
from plait.parallel.pipeline.step import run_pipeline_forward
from plait.parallel.stages import RankStages
from plait.planner.pipeline_plan import PipelinePlan
from plait.planner.schedules import forward_only
from plait.train.evaluation import EvalSide, greedy_by_forward, next_token_ids
from plait.train.loss import token_loss_sum

__all__ = ["replica_eval_side"]


def replica_eval_side(stages: RankStages, plan: PipelinePlan, comm: PipelineComm, replicas: tuple[int, int],
                      group: Any, tokenizer: Any, stop_ids: Sequence[int], max_new_tokens: int,
                      pad_id: int) -> EvalSide:
    """This rank's part in a validation through its pipeline (module docstring).

    Args:
        stages, plan, comm: this rank's stages, its pipeline's plan and its :class:`PipelineComm`.
        replicas: ``(pipelines, this pipeline's index)``: how the validation samples are shared.
        group: the process group of this pipeline's ranks (the next-token agreement), or None for a one-rank
            pipeline.
        tokenizer, stop_ids, max_new_tokens, pad_id: greedy decoding (answers decoded to text).
    """
    schedules: dict[int, Any] = {}

    def forward(batches: list[Batch], output_fn: Any) -> list[torch.Tensor]:
        if len(batches) not in schedules:
            schedules[len(batches)] = forward_only(plan, len(batches))
        return run_pipeline_forward(stages, schedules[len(batches)], batches, comm, output_fn=output_fn)

    def answers(batches: list[Batch]) -> list[list[str]]:
        rows = [b.input_ids.shape[0] for b in batches]

        def next_tokens(current: list[Batch]) -> list[torch.Tensor]:
            outs = forward(current, next_token_ids)
            tokens = torch.cat(outs) if outs else torch.full((sum(rows),), -1, dtype=torch.long)
            if group is not None:
                dist.all_reduce(tokens, op=dist.ReduceOp.MAX, group=group)
            return list(tokens.split(rows))

        new = greedy_by_forward(next_tokens, batches, list(stop_ids), max_new_tokens, pad_id)
        return [tokenizer.batch_decode(t, skip_special_tokens=True) for t in new]

    first = comm.pp_rank == 0
    return EvalSide(replicas, replicas, first, first, max(2 * len(comm.pp_ranks), 1),
                    lambda batches: forward(batches, token_loss_sum), answers)
