"""The trainer of pipeline-parallel jobs (``parallel.pp.degree`` > 1): :class:`~plait.train.trainer.Trainer`'s one
loop with the DP x PP x CP layout, the model built on the meta device and each rank's units materialised
(:func:`plait.parallel.parallelize.parallelize`), and the pipelined step runner
(:class:`~plait.train.pipeline_run.PipelineRunner`, which documents the layout, the step, validation and the
timeline).
"""

from __future__ import annotations

from plait.config.schema import JobConfig
from plait.parallel.dims import ParallelDims
from plait.train.trainer import Trainer

__all__ = ["PipelineTrainer"]


class PipelineTrainer(Trainer):
    """:class:`Trainer` for ``parallel.pp.degree`` > 1: same loop, losses, checkpoints and metrics; forward/backward
    and validation through this rank's pipeline stage(s) (:class:`~plait.train.pipeline_run.PipelineRunner`).

    Attributes (besides the trainer's):
        comm: this rank's PP/DP coordinates (``PipelineComm``).
        pp, pp_rank: pipeline degree and this rank's pipeline coordinate.
        plan: the pipeline plan (``PipelinePlan``; stage ranks from ``parallel.pp``).
        stages: this rank's stages (``RankStages``); ``model`` is the pruned composite they run.

    Raises:
        ValueError: when the world size is not a multiple of ``parallel.pp.degree`` x ``parallel.cp`` (or
            ``parallel.dp`` x degree x cp differs from it), ``parallel.pp.microbatches`` exceeds a DP replica's
            share of the global batch, or the stage counts and placement
            (``parallel.pp.stages``/``splits``/``virtual_stages``/``attach_encoders``) do not fit the model.
    """

    materializes_own_units = True

    @staticmethod
    def layout(cfg: JobConfig, world_size: int) -> ParallelDims:
        """The DP x PP x CP layout of ``cfg`` on ``world_size`` processes.

        Raises:
            ValueError: when the degrees do not fit the world size (:meth:`ParallelDims.from_world`).
        """
        par = cfg.parallel
        dims = ParallelDims.from_world(world_size, par.pp.degree, par.cp, par.dp, par.dp_shard, par.tp, ep=par.ep)
        return dims.ordered(par.rank_order, par.gpus_per_node)
