"""The pipeline runtime (it only executes): one file per job.

- :mod:`.comm`: this process's place in a DP x PP x CP job (:class:`PipelineComm`), its process groups and the
  receive capacities its channels keep across steps (:class:`ChannelCapacities`);
- :mod:`.wire`: the message format (header, packed buffer);
- :mod:`.transport`: ordered P2P messages of a step, pre-posted receives;
- :mod:`.executor`: one rank's ``F``/``B``/``W`` actions, frozen-aware, with deferred encoder outputs;
- :mod:`.step`: :func:`run_pipeline_step` (execute, reduce over DP x CP and tied copies), clipping, timeline;
  :func:`run_pipeline_forward` (forward passes only, for evaluation).
"""

from plait.parallel.pipeline.comm import PipelineComm, build_pipeline_comm, pipeline_comm_from_mesh
from plait.parallel.pipeline.step import (
    PipelineStepResult,
    clip_grad_norm_pipeline,
    gather_timeline,
    run_pipeline_forward,
    run_pipeline_step,
)

__all__ = ["PipelineComm", "PipelineStepResult", "build_pipeline_comm", "clip_grad_norm_pipeline",
           "gather_timeline", "pipeline_comm_from_mesh", "run_pipeline_forward",
           "run_pipeline_step"]
