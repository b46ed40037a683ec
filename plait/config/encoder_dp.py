"""``parallel.pp.encoder_dp``: an encoder branch's own data-parallel degree inside each pipeline (replicated encoder
stages, :class:`plait.planner.pipeline.types.Stage`), checked when a job config is built."""

from __future__ import annotations

from plait.config.schema import JobConfig, PipelineConfig
from plait.planner.types import LLM_MODULE

__all__ = ["replica_note", "validate_encoder_dp"]


def validate_encoder_dp(cfg: JobConfig) -> None:
    """``parallel.pp.encoder_dp``: integers >= 1 per encoder branch; above 1 only in an ``encoder_parallel``
    pipeline (``degree`` > 1) without ``attach_encoders``, ``virtual_stages`` > 1 or FSDP2, and, with
    ``encoders_in_bubble``, at most ``degree`` (each replica on its own LLM rank); at most ``train.microbatch_size``
    (each replica takes at least one sample of a microbatch, as the planner's ``encoder_dp_bounds``). Branch names are checked against
    the model in :func:`pipeline_stage_counts`.

    Raises:
        ValueError: naming ``parallel.pp.encoder_dp`` and the offending entry or setting.
    """
    pp = cfg.parallel.pp
    _require(isinstance(pp.encoder_dp, dict), f"parallel.pp.encoder_dp must be a table of encoder branch = degree, "
           f"got {pp.encoder_dp!r}")
    for branch, degree in pp.encoder_dp.items():
        _require(branch != LLM_MODULE, "parallel.pp.encoder_dp.llm: the LLM's data-parallel degree is parallel.dp; "
               "encoder_dp names encoder branches")
        _require(isinstance(degree, int) and not isinstance(degree, bool) and degree >= 1,
               f"parallel.pp.encoder_dp.{branch} must be an integer >= 1, got {degree!r}")
    replicated = {b: d for b, d in pp.encoder_dp.items() if d > 1}
    if not replicated:
        return
    where = f"parallel.pp.encoder_dp = {replicated}"
    _require(pp.degree > 1, f"{where} replicates encoder stages of a pipeline: it needs parallel.pp.degree > 1")
    _require(pp.layout == "encoder_parallel", f"{where} needs parallel.pp.layout = 'encoder_parallel' (each branch its "
           f"own stages), got {pp.layout!r}")
    _require(not pp.attach_encoders, f"{where} puts each replica on its own rank; it does not combine with "
           "parallel.pp.attach_encoders = true (every encoder stage on the first LLM rank)")
    _require(pp.virtual_stages == 1, f"{where} runs with one LLM stage per rank, got parallel.pp.virtual_stages = "
           f"{pp.virtual_stages}")
    _require(cfg.parallel.dp_shard == 1, f"{where} does not combine with FSDP2 (parallel.dp_shard = "
           f"{cfg.parallel.dp_shard})")
    if pp.encoders_in_bubble:
        big = {b: d for b, d in replicated.items() if d > pp.degree}
        _require(not big, f"parallel.pp.encoder_dp {big}: with encoders_in_bubble each replica sits on a different LLM "
               f"rank, so at most parallel.pp.degree = {pp.degree}")
    rows = cfg.train.microbatch_size
    for branch, degree in replicated.items():
        _require(degree <= rows, f"parallel.pp.encoder_dp.{branch} = {degree} is larger than train.microbatch_size = "
                 f"{rows}: each replica encodes at least one sample of a microbatch, so at most {rows}")


def replica_note(pp: PipelineConfig, counts: dict[str, int]) -> str:
    """The part of a stage-count error that names ``parallel.pp.encoder_dp``: ``counts`` (stages per module) with
    each replicated branch's stages times its replicas (the ranks they take); ``""`` without replicas or with
    colocated encoders."""
    replicas = {m: d for m, d in pp.encoder_dp.items() if d > 1}
    if not replicas or pp.layout == "encoders_colocated":
        return ""
    ranks = {m: c * pp.encoder_dp.get(m, 1) for m, c in counts.items()}
    return f"; parallel.pp.encoder_dp = {replicas} replicas included: {ranks}"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
