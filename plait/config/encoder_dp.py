"""``parallel.pp.encoder_dp`` and ``parallel.pp.encoder_tp``: an encoder branch's own data-parallel degree
(replicated encoder stages) or tensor-parallel degree (a TP group per stage) inside each pipeline
(:class:`plait.planner.pipeline.types.Stage`), checked when a job config is built."""

from __future__ import annotations

import typing

from plait.config.schema import JobConfig, PipelineConfig
from plait.planner.types import LLM_MODULE

__all__ = ["branch_copies", "check_branch_names", "copy_kwargs", "replica_note", "validate_encoder_dp",
           "validate_encoder_tp"]


def validate_encoder_dp(cfg: JobConfig) -> None:
    """``parallel.pp.encoder_dp``: integers >= 1 per encoder branch; above 1 only in an ``encoder_parallel``
    pipeline (``degree`` > 1) without ``attach_encoders``, ``virtual_stages`` > 1 or FSDP2, and, with
    ``encoders_in_bubble``, at most ``degree`` (each replica on its own LLM rank); at most ``train.microbatch_size``
    (each replica takes at least one sample of a microbatch, as the planner's ``encoder_dp_bounds``). Branch names are checked against
    the model in :func:`pipeline_stage_counts`.

    Also checks ``parallel.pp.encoder_tp`` (:func:`validate_encoder_tp`).

    Raises:
        ValueError: naming ``parallel.pp.encoder_dp`` and the offending entry or setting.
    """
    validate_encoder_tp(cfg)
    pp = cfg.parallel.pp
    replicated = _branch_degrees("encoder_dp", pp.encoder_dp, "the LLM's data-parallel degree is parallel.dp")
    if not replicated:
        return
    where = f"parallel.pp.encoder_dp = {replicated}"
    _require_encoder_stages(pp, where, "replicates")
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


def validate_encoder_tp(cfg: JobConfig) -> None:
    """``parallel.pp.encoder_tp``: integers >= 1 per encoder branch; above 1 only in an ``encoder_parallel``
    pipeline (``degree`` > 1) whose encoder stages sit on ranks of their own (no ``attach_encoders`` nor
    ``encoders_in_bubble``), with ``virtual_stages`` 1, ``parallel.tp`` 1, no FSDP2 and no ``encoder_dp`` above 1 on
    the same branch. Branch names are checked against the model in :func:`pipeline_stage_counts`; the degree
    against the tower's heads and TP plan when the trainer is built (``train.build.check_tp_degree``).

    Raises:
        ValueError: naming ``parallel.pp.encoder_tp`` and the offending entry or setting.
    """
    pp = cfg.parallel.pp
    split = _branch_degrees("encoder_tp", pp.encoder_tp, "the LLM's tensor-parallel degree is parallel.tp")
    if not split:
        return
    where = f"parallel.pp.encoder_tp = {split}"
    _require_encoder_stages(pp, where, "splits")
    for flag in ("attach_encoders", "encoders_in_bubble"):
        _require(not getattr(pp, flag), f"{where} puts each TP stage on ranks of its own; it does not combine with "
                 f"parallel.pp.{flag} = true (encoder stages on LLM ranks)")
    _require(pp.virtual_stages == 1, f"{where} runs with one LLM stage per rank, got parallel.pp.virtual_stages = "
             f"{pp.virtual_stages}")
    _require(cfg.parallel.tp == 1, f"{where} does not combine with the job's own tensor parallelism (parallel.tp = "
             f"{cfg.parallel.tp})")
    _require(cfg.parallel.dp_shard == 1, f"{where} does not combine with FSDP2 (parallel.dp_shard = "
             f"{cfg.parallel.dp_shard})")
    both = sorted(b for b in split if pp.encoder_dp.get(b, 1) > 1)
    _require(not both, f"{where}: branch(es) {both} also have parallel.pp.encoder_dp above 1; a branch has either "
             "replicas or a TP group")


def branch_copies(pp: PipelineConfig, branch: str) -> int:
    """Ranks each stage of ``branch`` takes: its ``encoder_dp`` replicas times its ``encoder_tp`` degree."""
    return pp.encoder_dp.get(branch, 1) * pp.encoder_tp.get(branch, 1)


def check_branch_names(pp: PipelineConfig, encoders: typing.Sequence[str]) -> None:
    """``parallel.pp.encoder_dp`` and ``encoder_tp`` name only the model's encoder branches.

    Raises:
        ValueError: naming the field and the unknown branches.
    """
    for name in ("encoder_dp", "encoder_tp"):
        unknown = sorted(set(getattr(pp, name)) - set(encoders))
        _require(not unknown, f"parallel.pp.{name} names unknown encoder branch(es) {unknown}; the model's are "
                 f"{list(encoders)}")


def copy_kwargs(pp: PipelineConfig) -> dict[str, dict[str, int]]:
    """``plan_pipeline``'s ``replicas`` (``encoder_dp`` above 1) and ``tensor_parallel`` (``encoder_tp`` above 1)."""
    return {"replicas": {m: d for m, d in pp.encoder_dp.items() if d > 1},
            "tensor_parallel": {m: t for m, t in pp.encoder_tp.items() if t > 1}}


def replica_note(pp: PipelineConfig, counts: dict[str, int]) -> str:
    """The part of a stage-count error that names ``parallel.pp.encoder_dp`` / ``encoder_tp``: ``counts`` (stages per
    module) with each branch's stages times its replicas or TP degree (the ranks they take); ``""`` without either
    or with colocated encoders."""
    replicas = {m: d for m, d in pp.encoder_dp.items() if d > 1}
    split = {m: t for m, t in pp.encoder_tp.items() if t > 1}
    if not (replicas or split) or pp.layout == "encoders_colocated":
        return ""
    ranks = {m: c * branch_copies(pp, m) for m, c in counts.items()}
    named = " and ".join(f"parallel.pp.{f} = {d}" for f, d in (("encoder_dp", replicas), ("encoder_tp", split)) if d)
    return f"; {named} copies included: {ranks}"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _require_encoder_stages(pp: PipelineConfig, where: str, verb: str) -> None:
    """A per-encoder degree (``where``: the field and its entries above 1, ``verb``: what it does to the encoder
    stages) needs a pipeline whose encoder branches have stages of their own.

    Raises:
        ValueError: naming ``where`` when ``parallel.pp.degree`` is 1 or the layout is not ``encoder_parallel``.
    """
    _require(pp.degree > 1, f"{where} {verb} encoder stages of a pipeline: it needs parallel.pp.degree > 1")
    _require(pp.layout == "encoder_parallel", f"{where} needs parallel.pp.layout = 'encoder_parallel' (each branch its "
             f"own stages), got {pp.layout!r}")


def _branch_degrees(name: str, table: object, llm_note: str) -> dict[str, int]:
    """``parallel.pp.<name>`` (a table of encoder branch = degree) checked: a table, no ``llm`` entry, integers >= 1.
    Returns the entries above 1.

    Raises:
        ValueError: naming ``parallel.pp.<name>`` and the offending entry.
    """
    _require(isinstance(table, dict), f"parallel.pp.{name} must be a table of encoder branch = degree, got {table!r}")
    for branch, degree in table.items():
        _require(branch != LLM_MODULE, f"parallel.pp.{name}.llm: {llm_note}; {name} names encoder branches")
        _require(isinstance(degree, int) and not isinstance(degree, bool) and degree >= 1,
                 f"parallel.pp.{name}.{branch} must be an integer >= 1, got {degree!r}")
    return {b: d for b, d in table.items() if d > 1}
