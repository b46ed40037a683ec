"""TOML job files -> :class:`~plait.config.schema.JobConfig`, with dotted overrides and validation."""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from plait.config.schema import (DATA_FORMATS, DataConfig, EncoderConfig, JobConfig, LoraConfig, PipelineConfig,
                                 check_checkpointing)
from plait.config.encoder_dp import branch_copies, check_branch_names, copy_kwargs, replica_note, validate_encoder_dp
from plait.planner.cost.topology import RANK_ORDERS
from plait.planner.microbatch import METHODS
from plait.planner.pipeline.plan import stage_ranks
from plait.planner.pipeline.types import LAYOUTS
from plait.planner.pipeline.schedules import IN_BUBBLE_SCHEDULES, SCHEDULE_NAMES
from plait.planner.types import LLM_MODULE

__all__ = ["load_config", "read_config_data", "config_from_dict", "parse_overrides", "config_to_dict", "pipeline_stage_counts",
           "pipeline_plan_kwargs"]


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> JobConfig:
    """Read a TOML job file, apply ``--section.key=value`` overrides and validate.

    Paths in the file (tokenizer, data files, model directories) are used as written, so relative ones are
    relative to the working directory (``configs/demo.toml`` is meant to be run from the repository root);
    media paths inside a JSONL data file are relative to that file.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: on TOML syntax errors, unknown sections/keys, wrong value types or invalid values,
            naming the offending dotted key.
    """
    cfg = config_from_dict(read_config_data(path, overrides))
    validate(cfg)
    return cfg


def read_config_data(path: str | Path, overrides: typing.Sequence[str] = ()) -> dict[str, Any]:
    """The nested tables of a TOML job file with the ``--section.key=value`` overrides applied, not yet
    checked (``config_from_dict`` and ``validate`` do that). ``metrics.run_dir`` defaults to
    ``runs/<job file name without .toml>`` (relative to the working directory) when absent or empty, so jobs do
    not share a folder.

    Raises:
        FileNotFoundError: when ``path`` does not exist or is a folder (naming the job files in it).
        ValueError: on TOML syntax errors or a malformed override.
    """
    path = Path(path)
    if path.is_dir():
        found = sorted(q.name for q in path.glob("*.toml"))
        raise FileNotFoundError(f"config file {path} is a folder, not a job file"
                                + (f"; it holds {', '.join(found[:5])}" if found else ""))
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: invalid TOML: {exc}") from exc
    for key, value in parse_overrides(overrides).items():
        _set_dotted(data, key, value)
    if isinstance(data.setdefault("metrics", {}), dict):
        if not data["metrics"].get("run_dir"):  # absent or empty (``--metrics.run_dir=``): the default
            data["metrics"]["run_dir"] = f"runs/{path.stem}"
    return data


def parse_overrides(args: typing.Sequence[str]) -> dict[str, Any]:
    """Parse ``["--train.lr=1e-3", "--data.on_error=skip"]`` into ``{"train.lr": 0.001, ...}``.

    Values are read as TOML values when they parse (numbers, booleans, arrays, quoted strings) and as
    plain strings otherwise.

    Raises:
        ValueError: for an argument without ``=`` or without a dotted key.
    """
    out: dict[str, Any] = {}
    for arg in args:
        body = arg[2:] if arg.startswith("--") else arg
        if "=" not in body:
            raise ValueError(f"override {arg!r} must look like --section.key=value")
        key, raw = body.split("=", 1)
        if "." not in key:
            raise ValueError(f"override {arg!r}: key must be dotted, e.g. --train.lr=1e-3")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        out[key] = value
    return out


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {key!r}: {part!r} is not a section")
    node[parts[-1]] = value


def config_from_dict(data: dict[str, Any]) -> JobConfig:
    """Build a :class:`JobConfig` from nested dicts (parsed TOML), checking every key and type.

    Raises:
        ValueError: naming the dotted key of an unknown field or a value of the wrong type.
    """
    return _build(JobConfig, data, "")


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown config key(s) {[_join(where, k) for k in unknown]}{_close_keys(unknown, names, where)}"
                         f"; known: {sorted(names)}")
    kwargs = {name: _coerce(hints[name], value, _join(where, name)) for name, value in data.items()}
    return cls(**kwargs)


def _close_keys(unknown: typing.Sequence[str], names: typing.Collection[str], where: str) -> str:
    """The "did you mean" of unknown keys: ``" (did you mean train.lr?)"``, for several keys ``" (train.lrr: did
    you mean train.lr?; ...)"``, only the keys with close matches among ``names`` (``difflib.get_close_matches``
    with its default cutoff 0.6, as ``plait.models.processor_table.check_processor_table``); empty when none has."""
    hints = {}
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(names), n=3)
        if close:
            hints[_join(where, key)] = " or ".join(_join(where, c) for c in close)
    if not hints:
        return ""
    if len(unknown) == 1:
        return f" (did you mean {next(iter(hints.values()))}?)"
    return " (" + "; ".join(f"{key}: did you mean {close}?" for key, close in hints.items()) + ")"


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, where)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0])
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a table, got {value!r}")
        if args and dataclasses.is_dataclass(args[1]):
            return {k: _build(args[1], v, _join(where, k)) for k, v in value.items()}
        return dict(value)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        return [_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ValueError(f"{where}: expected {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, where) for a, v in zip(args, value))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is Any:
        return value
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ValueError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def validate(cfg: JobConfig) -> None:
    """Check value ranges and cross-field rules.

    Raises:
        ValueError: naming the dotted key of the first invalid value.
    """
    t = cfg.train
    _check(t.global_batch_size >= 1, "train.global_batch_size must be >= 1")
    _check(t.microbatch_size >= 1, "train.microbatch_size must be >= 1")
    if t.microbatch_size > t.global_batch_size:  # legal (one microbatch per step), but say so
        logging.getLogger(__name__).warning(
            "train.microbatch_size (%d) is larger than train.global_batch_size (%d): every step is one microbatch "
            "of at most %d samples", t.microbatch_size, t.global_batch_size, t.global_batch_size)
    _check(t.steps >= 0 and t.epochs > 0, "train.steps must be >= 0 and train.epochs > 0")
    _check(t.threads >= 0, f"train.threads must be >= 0 (0: automatic), got {t.threads}")
    _check(t.lr > 0 and 0 <= t.min_lr_ratio <= 1, "train.lr must be > 0 and train.min_lr_ratio in [0, 1]")
    _check(t.dtype in ("auto", "fp32", "bf16"), f"train.dtype must be auto, fp32 or bf16, got {t.dtype!r}")
    _check(t.microbatch_policy in METHODS,
           f"train.microbatch_policy must be one of {METHODS}, got {t.microbatch_policy!r}")
    _check(t.device in ("auto", "cpu", "cuda"), f"train.device must be auto, cpu or cuda, got {t.device!r}")
    _validate_loop(cfg)
    _validate_checkpointing(cfg)
    d = cfg.data
    _check(d.on_error in ("raise", "skip"), f"data.on_error must be 'raise' or 'skip', got {d.on_error!r}")
    _check(d.max_length >= 2, "data.max_length must be >= 2")
    _check(d.num_workers >= 0, f"data.num_workers must be >= 0, got {d.num_workers}")
    _check(d.prefetch >= 1, f"data.prefetch must be >= 1, got {d.prefetch}")
    _validate_sources(d)
    _check(cfg.parallel.backend in ("auto", "gloo", "nccl"), "parallel.backend must be auto, gloo or nccl")
    _check(cfg.parallel.dp >= 0, f"parallel.dp must be >= 0 (0: world size / (dp_shard x pp x cp x tp)), "
           f"got {cfg.parallel.dp}")
    _check(cfg.parallel.cp >= 1, f"parallel.cp must be >= 1 (1: no context parallelism), got {cfg.parallel.cp}")
    _check(math.isfinite(cfg.parallel.timeout_s) and cfg.parallel.timeout_s > 0,
           f"parallel.timeout_s must be a positive number of seconds, got {cfg.parallel.timeout_s}")
    _check(cfg.parallel.dp_shard >= 1, f"parallel.dp_shard must be >= 1 (1: no sharding), got {cfg.parallel.dp_shard}")
    _check(cfg.parallel.tp >= 1, f"parallel.tp must be >= 1 (1: no tensor parallelism), got {cfg.parallel.tp}")
    _validate_expert_parallel(cfg)
    _validate_fsdp_options(cfg.parallel)
    _check(cfg.parallel.cp_distribution in ("uniform", "zigzag", "lpt", "ilp"),
           f"parallel.cp_distribution must be uniform, zigzag, lpt or ilp, got {cfg.parallel.cp_distribution!r}")
    _check(cfg.parallel.plan in ("manual", "auto"),
           f"parallel.plan must be 'manual' or 'auto', got {cfg.parallel.plan!r}")
    _check(cfg.parallel.rank_order in ("auto", *RANK_ORDERS),
           f"parallel.rank_order must be auto, {' or '.join(RANK_ORDERS)}, got {cfg.parallel.rank_order!r}")
    _check(isinstance(cfg.parallel.gpus_per_node, int) and cfg.parallel.gpus_per_node >= 0,
           f"parallel.gpus_per_node must be an integer >= 0 (0: from torchrun), got {cfg.parallel.gpus_per_node!r}")
    _validate_pipeline(cfg)
    a = cfg.attention
    _check(a.mask in ("causal", "bidirectional_items"),
           f"attention.mask must be 'causal' or 'bidirectional_items', got {a.mask!r}")
    _check(a.implementation in ("auto", "hf", "plait", "plait_sdpa"),
           f"attention.implementation must be auto, hf, plait or plait_sdpa, got {a.implementation!r}")
    needs_plait = a.mask != "causal" or cfg.parallel.cp > 1 or d.packing
    _check(not (needs_plait and a.implementation == "hf"),
           "attention.implementation='hf' supports only causal, unpacked, non-CP training; use 'plait' or 'auto'")
    _check(a.block_size >= 1, "attention.block_size must be >= 1")
    m = cfg.model
    if m.pretrained is None:
        _check((m.llm.path is None) != (m.llm.config is None), "model.llm: give exactly one of path and config")
    for name, enc in m.encoders.items():
        _validate_encoder(name, enc, m.pretrained is not None, _known_encoders(m.encoders))
    _validate_lora(m.llm.lora, "model.llm.lora")
    _validate_energy(cfg)


def _validate_loop(cfg: JobConfig) -> None:
    """Plain ranges of the optimizer, validation, checkpoint and metrics settings (``train``, ``checkpoint``,
    ``metrics``, ``data.val_max_samples``), checked with the rest of the job before anything heavy is imported.

    Raises:
        ValueError: naming the field, its range and the value.
    """
    t = cfg.train
    _check(t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
    _check(math.isfinite(t.weight_decay) and t.weight_decay >= 0,
           f"train.weight_decay must be >= 0 (0: no weight decay), got {t.weight_decay}")
    _check(all(0 <= b < 1 for b in t.betas), f"train.betas must both be in [0, 1) (AdamW's), got {list(t.betas)}")
    _check(math.isfinite(t.grad_clip) and t.grad_clip >= 0,
           f"train.grad_clip must be >= 0 (0: no clipping), got {t.grad_clip}")
    _check(t.eval_every >= 0, f"train.eval_every must be >= 0 (0: only at the end), got {t.eval_every}")
    _check(t.max_new_tokens >= 1, f"train.max_new_tokens must be >= 1, got {t.max_new_tokens}")
    _check(t.eval_batch_size >= 0, f"train.eval_batch_size must be >= 0 (0: max(train.microbatch_size, 16)), "
           f"got {t.eval_batch_size}")
    vmax = cfg.data.val_max_samples
    _check(vmax is None or vmax >= 1, f"data.val_max_samples must be >= 1 (leave it unset for every validation "
           f"record; no data.val for none), got {vmax}")
    c = cfg.checkpoint
    _check(c.every >= 0, f"checkpoint.every must be >= 0 (0: only at the end), got {c.every}")
    _check(c.keep >= 0, f"checkpoint.keep must be >= 0 (0: keep all), got {c.keep}")
    _check(cfg.metrics.log_every >= 1, f"metrics.log_every must be >= 1 (a row every N steps), "
           f"got {cfg.metrics.log_every}")


def _validate_energy(cfg: JobConfig) -> None:
    """``[energy]``: a plan only for pipeline jobs; the straggler hysteresis of ``planner.straggler``.

    Raises:
        ValueError: naming the ``energy`` field.
    """
    e = cfg.energy
    _check(not e.plan or cfg.parallel.pp.degree > 1, f"energy.plan = {e.plan!r} sets the frequency of pipeline "
           "actions: it needs parallel.pp.degree > 1")
    _check(1 <= e.recover_ratio < e.slow_ratio, f"energy.recover_ratio must be >= 1 and below energy.slow_ratio, "
           f"got {e.recover_ratio} and {e.slow_ratio}")
    _check(e.patience >= 1, f"energy.patience must be >= 1, got {e.patience}")


def _validate_checkpointing(cfg: JobConfig) -> None:
    """``train.activation_checkpointing`` and its per-module overrides are policies of ``planner.recompute``
    (checked again here: a field may have been set after the dataclass was built)."""
    fields = {"train.activation_checkpointing": cfg.train.activation_checkpointing,
              "model.llm.activation_checkpointing": cfg.model.llm.activation_checkpointing}
    fields.update({f"model.encoders.{name}.activation_checkpointing": enc.activation_checkpointing
                   for name, enc in cfg.model.encoders.items()})
    for field_name, value in fields.items():
        check_checkpointing(field_name, value, follows=field_name != "train.activation_checkpointing")


def _validate_sources(d: DataConfig) -> None:
    """``[[data.sources]]``: instead of ``data.train``/``data.val``; each with a path, a positive finite weight,
    a known format (or none) and a unique name (its ``name`` or the file's stem).

    Raises:
        ValueError: naming the offending ``data.sources[i]`` field.
    """
    _check(d.epoch_samples >= 0, f"data.epoch_samples must be >= 0 (0: the sum of the sources' samples), "
           f"got {d.epoch_samples}")
    if not d.sources:
        _check(d.epoch_samples == 0, "data.epoch_samples is the epoch length of a mixture: it needs [[data.sources]]")
        return
    _check(not d.train, f"give data.train or [[data.sources]], not both (data.train = {d.train!r})")
    _check(d.val is None, "data.val with [[data.sources]]: give each source's validation file as its 'val'")
    names: dict[str, int] = {}
    for i, src in enumerate(d.sources):
        at = f"data.sources[{i}]"
        _check(bool(src.path), f"{at}.path must name a data file")
        _check(math.isfinite(src.weight) and src.weight > 0, f"{at}.weight must be positive and finite, got {src.weight}")
        _check(src.format in ("",) + DATA_FORMATS,
               f"{at}.format must be one of {', '.join(DATA_FORMATS)} (or empty: from the extension), got {src.format!r}")
        name = src.name or Path(src.path).stem
        _check(name not in names, f"{at}.name {name!r} is already the name of data.sources[{names.get(name)}]; "
               "give each source a unique 'name'")
        names[name] = i


def _validate_expert_parallel(cfg: JobConfig) -> None:
    """``parallel.ep``: >= 1; above 1 only without TP (the all-to-all dispatch is not combined with TP's split of
    the experts' weights). The LLM's expert count and the world size are checked when the job starts."""
    p = cfg.parallel
    _check(isinstance(p.ep, int) and p.ep >= 1, f"parallel.ep must be an integer >= 1 (1: no expert parallelism), "
           f"got {p.ep!r}")
    _check(p.ep == 1 or p.tp == 1, f"parallel.ep = {p.ep} works with parallel.tp = 1, got tp = {p.tp}")


def _validate_fsdp_options(p: Any) -> None:
    """``parallel.offload``, ``parallel.fsdp_reduce`` and ``parallel.fsdp_reshard``: FSDP2 settings for jobs without
    pipeline stages (:func:`_check_fsdp_option`)."""
    _check_fsdp_option(p, "offload", ("none", "cpu"), "offloads FSDP2's shards to the host",
                       "a stage's parameters and gradients stay whole on the device through the step, so offload would "
                       "move only the optimizer state (not supported)", wrapping=" (FSDP2 wrapping)")
    _check_fsdp_option(p, "fsdp_reduce", ("step", "microbatch"), "reduce-scatters FSDP2's gradients",
                       "each stage's gradients are reduce-scattered once after its last backward")
    _check_fsdp_option(p, "fsdp_reshard", ("auto", "after_forward", "after_backward"),
                       "says when FSDP2 frees its gathered parameters", "each stage's parameters are gathered once per "
                       "step and kept whole until its reduction (leave it 'auto')")


def _check_fsdp_option(p: Any, name: str, choices: tuple[str, ...], does: str, under_stages: str,
                       wrapping: str = "") -> None:
    """``parallel.<name>`` is one of ``choices``; any but the first (the default) acts on FSDP2's shards of a job
    without pipeline stages, so it needs ``parallel.dp_shard > 1`` and ``parallel.pp.degree = 1``.

    Args:
        does: what a value other than the default does, for the message (``"... <does>: it needs ..."``).
        under_stages: why pipeline stages refuse it (``"under pipeline stages <under_stages>, got ..."``).
        wrapping: a note after ``parallel.dp_shard > 1`` in the message.

    Raises:
        ValueError: naming ``parallel.<name>``, its value and the degree it needs.
    """
    value = getattr(p, name)
    listed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
    _check(value in choices, f"parallel.{name} must be {listed}, got {value!r}")
    if value == choices[0]:
        return
    _check(p.dp_shard > 1, f"parallel.{name} = {value!r} {does}: it needs parallel.dp_shard > 1{wrapping}, "
           f"got dp_shard = {p.dp_shard}")
    _check(p.pp.degree == 1, f"parallel.{name} = {value!r} needs parallel.pp.degree = 1: under pipeline stages "
           f"{under_stages}, got pp.degree = {p.pp.degree}")


def _validate_pipeline(cfg: JobConfig) -> None:
    pp = cfg.parallel.pp
    _check(pp.degree >= 1, f"parallel.pp.degree must be >= 1, got {pp.degree}")
    _check(pp.layout in LAYOUTS, f"parallel.pp.layout must be one of {LAYOUTS}, got {pp.layout!r}")
    _check(pp.schedule in SCHEDULE_NAMES, f"parallel.pp.schedule must be one of {SCHEDULE_NAMES}, got {pp.schedule!r}")
    _check(pp.virtual_stages >= 1, f"parallel.pp.virtual_stages must be >= 1 (LLM stages per LLM rank), "
           f"got {pp.virtual_stages}")
    _check(pp.microbatches >= 0, f"parallel.pp.microbatches must be >= 0 (0: from train.microbatch_size), "
           f"got {pp.microbatches}")
    _validate_pipeline_schedule(pp)
    validate_encoder_dp(cfg)
    if pp.degree == 1:
        return
    if cfg.model.pretrained is None:  # a pretrained composite's branches are known only once it is loaded
        pipeline_stage_counts(pp, list(cfg.model.encoders))


def _validate_pipeline_schedule(pp: PipelineConfig) -> None:
    """A schedule that runs several stages per rank (``interleaved_1f1b``, ``zb_v``) exactly when a rank holds
    several stages (``virtual_stages`` > 1 or ``attach_encoders``), which needs several pipeline ranks; ``zb_v``
    with ``virtual_stages = 2`` (its V); ``cap`` only with ``memory_capped_1f1b``.

    Raises:
        ValueError: naming the offending ``parallel.pp`` field.
    """
    shared = pp.virtual_stages > 1 or pp.attach_encoders
    placement = " and ".join([f"parallel.pp.virtual_stages={pp.virtual_stages}"] * (pp.virtual_stages > 1)
                             + ["parallel.pp.attach_encoders=true"] * pp.attach_encoders)
    if pp.encoders_in_bubble:
        _check(not shared, f"parallel.pp.encoders_in_bubble = true puts the encoder stages on LLM ranks of one LLM "
               f"stage each; it does not combine with {placement}")
        _check(pp.schedule in IN_BUBBLE_SCHEDULES, f"parallel.pp.encoders_in_bubble = true runs with the schedules "
               f"{', '.join(IN_BUBBLE_SCHEDULES)} (they place each encoder action where its rank would otherwise "
               f"wait), got {pp.schedule!r}")
        _check(pp.degree > 1, "parallel.pp.encoders_in_bubble = true puts the encoders in the bubbles of a "
               "pipeline, but parallel.pp.degree = 1 has none: raise parallel.pp.degree or set it false")
    if pp.schedule == "interleaved_1f1b":
        _check(shared, "parallel.pp.schedule = 'interleaved_1f1b' needs several stages per pipeline rank: set "
               "parallel.pp.virtual_stages >= 2 (LLM stages per LLM rank) or parallel.pp.attach_encoders = true "
               "(encoder stages on the first LLM rank); with one stage per rank use '1f1b'")
    elif pp.schedule == "zb_v":
        _check(pp.virtual_stages == 2, "parallel.pp.schedule = 'zb_v' runs 2 LLM stages per LLM rank in a V: set "
               f"parallel.pp.virtual_stages = 2, got {pp.virtual_stages}")
    else:
        _check(not shared, f"{placement} put several stages on a pipeline rank, which only parallel.pp.schedule = "
               f"'interleaved_1f1b' or 'zb_v' runs; got {pp.schedule!r}")
    _check(pp.degree > 1 or not shared, f"{placement} place stages on several pipeline ranks, but "
           "parallel.pp.degree = 1 runs the whole model on one rank: raise parallel.pp.degree or leave them at 1 "
           "and false")
    if pp.schedule == "memory_capped_1f1b":
        _check(pp.cap >= 1, f"parallel.pp.cap must be >= 1 with schedule 'memory_capped_1f1b', got {pp.cap}")
    else:
        _check(pp.cap == 0, f"parallel.pp.cap={pp.cap} is only used by schedule 'memory_capped_1f1b'; "
               f"the schedule is {pp.schedule!r}")


def pipeline_stage_counts(pp: PipelineConfig, encoders: typing.Sequence[str]) -> dict[str, int]:
    """Stages per module (``encoders`` in model order, then ``"llm"``) for ``parallel.pp``, defaults filled in:
    an encoder not named in ``pp.stages`` gets 1 stage (under ``encoders_colocated``, the count of the named
    encoders), the LLM gets ``pp.virtual_stages`` x the ranks the encoders leave of ``pp.degree``. Ranks: each
    encoder stage takes one (encoder stages count once per chunk position when colocated; none with
    ``pp.attach_encoders``: they share the first LLM rank) and the LLM ``stages / pp.virtual_stages``; the total
    is ``pp.degree``. A module with explicit boundaries in ``pp.splits`` has ``len(boundaries) + 1`` stages. A branch
    replicated by ``pp.encoder_dp`` (split by ``pp.encoder_tp``) takes that many ranks per stage.

    Raises:
        ValueError: for an unknown module (in ``pp.stages`` or ``pp.encoder_dp``), bad ``pp.splits`` (``_split_counts``), a count below 1, colocated
            encoders with different counts, ``attach_encoders`` without encoders, no stage left for the LLM, an
            LLM stage count that is not a multiple of ``virtual_stages`` or gives one LLM rank with
            ``virtual_stages`` > 1, or ranks other than ``pp.degree``.
    """
    known = [*encoders, LLM_MODULE]
    unknown = sorted(set(pp.stages) - set(known))
    _check(not unknown, f"parallel.pp.stages names unknown module(s) {unknown}; modules are {known}")
    for flag in ("attach_encoders", "encoders_in_bubble"):
        _check(not getattr(pp, flag) or encoders, f"parallel.pp.{flag} = true needs encoder branches; the model has "
               "none")
    stages = _split_counts(pp, known)
    for module, count in stages.items():
        _check(isinstance(count, int) and not isinstance(count, bool) and count >= 1,
               f"parallel.pp.stages.{module} must be an integer >= 1, got {count!r}")
    check_branch_names(pp, encoders)
    counts = _encoder_counts(pp, encoders, stages)
    encoder_stages = _encoder_stage_total(pp, counts)
    encoder_ranks = 0 if pp.attach_encoders or pp.encoders_in_bubble else encoder_stages
    v = pp.virtual_stages
    llm = stages.get(LLM_MODULE, v * (pp.degree - encoder_ranks))
    _check(llm >= 1, f"parallel.pp: the encoders take {encoder_stages} of parallel.pp.degree={pp.degree} stages "
           f"(parallel.pp.encoder_dp / encoder_tp copies included), leaving none for the LLM")
    _check(llm % v == 0, f"parallel.pp: the LLM has {llm} stages, not a multiple of parallel.pp.virtual_stages={v} "
           "(LLM stages per LLM rank)")
    _check(v == 1 or llm // v >= 2, f"parallel.pp.virtual_stages={v} needs at least 2 LLM ranks (LLM stage j runs on "
           f"LLM rank j mod ranks), but the LLM's {llm} stages fill {llm // v}")
    ranks = encoder_ranks + llm // v
    if v == 1 and not (pp.attach_encoders or pp.encoders_in_bubble):
        _check(ranks == pp.degree, f"parallel.pp.stages give {ranks} stages ({counts | {LLM_MODULE: llm}}, layout "
               f"{pp.layout}{replica_note(pp, counts | {LLM_MODULE: llm})}) but parallel.pp.degree is {pp.degree}: one stage per pipeline rank")
    where = ("on the first LLM rank" if pp.attach_encoders else "on the LLM ranks" if pp.encoders_in_bubble
             else "one rank each")
    _check(ranks == pp.degree, f"parallel.pp.stages give {ranks} pipeline ranks ({counts | {LLM_MODULE: llm}}, layout "
           f"{pp.layout}: {encoder_stages} encoder stage(s) {where}, {llm} LLM stages / virtual_stages={v}) but "
           f"parallel.pp.degree is {pp.degree}")
    return {**counts, LLM_MODULE: llm}


def _encoder_counts(pp: PipelineConfig, encoders: typing.Sequence[str], stages: dict[str, Any]) -> dict[str, int]:
    """Stages per encoder with the defaults filled in (``pipeline_stage_counts``).

    Raises:
        ValueError: when colocated encoders get different counts.
    """
    colocated = pp.layout == "encoders_colocated"
    default = next((stages[m] for m in encoders if m in stages), 1) if colocated else 1
    counts = {m: stages.get(m, default) for m in encoders}
    if colocated:
        _check(len(set(counts.values())) <= 1,
               f"parallel.pp.stages: encoders_colocated needs the same stage count for every encoder, got {counts}")
    return counts


def _encoder_stage_total(pp: PipelineConfig, counts: dict[str, int]) -> int:
    """Encoder stages of the plan: the sum of the branches' counts (each stage of a branch times its
    ``encoder_dp`` replicas), or the shared count when colocated."""
    if pp.layout == "encoders_colocated":
        return max(counts.values(), default=0)
    return sum(c * branch_copies(pp, m) for m, c in counts.items())


def _split_counts(pp: PipelineConfig, known: typing.Sequence[str]) -> dict[str, Any]:
    """``pp.stages`` with the count of every module in ``pp.splits`` (boundaries + 1) filled in.

    Raises:
        ValueError: for an unknown module in ``splits``, boundaries that are not a list of distinct unit names,
            or a ``stages`` count that disagrees with the module's splits.
    """
    unknown = sorted(set(pp.splits) - set(known))
    _check(not unknown, f"parallel.pp.splits names unknown module(s) {unknown}; modules are {known}")
    stages = dict(pp.stages)
    for module, names in pp.splits.items():
        strings = isinstance(names, list) and all(isinstance(n, str) and n for n in names)
        _check(strings and len(set(names)) == len(names),
               f"parallel.pp.splits.{module} must be a list of distinct unit names, got {names!r}")
        count = len(names) + 1
        _check(stages.get(module, count) == count, f"parallel.pp.stages.{module}={stages.get(module)} but "
               f"parallel.pp.splits.{module} gives {count} stages")
        stages[module] = count
    return stages


def pipeline_plan_kwargs(pp: PipelineConfig, encoders: typing.Sequence[str]) -> dict[str, Any]:
    """Keyword arguments of ``plan_pipeline`` for ``parallel.pp``: ``stages_per_module`` (counts of the modules
    cut evenly, :func:`pipeline_stage_counts`), ``splits`` (explicit boundaries of the others) and ``ranks`` (the
    pipeline rank of each stage, :func:`plait.planner.pipeline.plan.stage_ranks`: the placement the layout search
    uses for the same ``virtual_stages`` and ``attach_encoders``; a V under ``schedule = "zb_v"``; the encoders on
    the last LLM ranks with ``encoders_in_bubble``; every replica of a branch's stage counted), ``replicas``
    (``pp.encoder_dp`` above 1) and ``tensor_parallel`` (``pp.encoder_tp`` above 1).

    Raises:
        ValueError: as :func:`pipeline_stage_counts`.
    """
    counts = pipeline_stage_counts(pp, encoders)
    encoder_stages = _encoder_stage_total(pp, {m: counts[m] for m in encoders})
    ranks = stage_ranks(encoder_stages, counts[LLM_MODULE] // pp.virtual_stages, pp.virtual_stages,
                        pp.attach_encoders, v_shape=pp.schedule == "zb_v", in_bubble=pp.encoders_in_bubble)
    return {"stages_per_module": {m: c for m, c in counts.items() if m not in pp.splits},
            "splits": {m: list(names) for m, names in pp.splits.items()}, "ranks": list(ranks),
            **copy_kwargs(pp)}


def _known_encoders(encoders: typing.Mapping[str, EncoderConfig]) -> str:
    """The names of the encoders that have a ``path`` or ``config`` (the job's own), comma-separated."""
    return ", ".join(sorted(n for n, e in encoders.items() if e.path is not None or e.config is not None))


def _validate_encoder(name: str, enc: EncoderConfig, pretrained: bool, known: str = "") -> None:
    where = f"model.encoders.{name}"
    _check(enc.modality in ("image", "audio"), f"{where}.modality must be 'image' or 'audio', got {enc.modality!r}")
    _check(enc.select in ("full", "drop_cls", "post_norm"),
           f"{where}.select must be 'full', 'drop_cls' or 'post_norm'")
    _check(enc.projector in ("linear", "mlp", "gemma3"), f"{where}.projector must be 'linear', 'mlp' or 'gemma3'")
    _check(enc.downsample >= 1, f"{where}.downsample must be >= 1")
    _check(enc.lr_scale > 0, f"{where}.lr_scale must be > 0")
    _check(math.isfinite(enc.video.fps) and enc.video.fps >= 0,
           f"{where}.video.fps must be >= 0 (0: every frame), got {enc.video.fps}")
    _check(enc.video.max_frames >= 1, f"{where}.video.max_frames must be >= 1, got {enc.video.max_frames}")
    if not pretrained:
        _check(enc.path is not None or enc.config is not None,
               f"{where}: no such encoder in the job (encoders: {known or 'none'}); a new encoder needs path or config")
        _check((enc.path is None) != (enc.config is None), f"{where}: give exactly one of path and config")
    _validate_lora(enc.lora, f"{where}.lora")


def _validate_lora(lora: LoraConfig, where: str) -> None:
    """Check a ``[...lora]`` table; ``where`` is its dotted name (``model.llm.lora``) for the error.

    Raises:
        ValueError: naming the field: ``r < 0``, ``alpha <= 0``, ``dropout`` outside [0, 1), or an empty or
            repeated ``target_modules`` name.
    """
    _check(lora.r >= 0, f"{where}.r must be >= 0 (0 = no LoRA), got {lora.r}")
    _check(lora.alpha > 0, f"{where}.alpha must be > 0, got {lora.alpha}")
    _check(0 <= lora.dropout < 1, f"{where}.dropout must be in [0, 1), got {lora.dropout}")
    _check(all(lora.target_modules), f"{where}.target_modules has an empty name: {lora.target_modules}")
    _check(len(set(lora.target_modules)) == len(lora.target_modules),
           f"{where}.target_modules repeats a name: {lora.target_modules}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def config_to_dict(cfg: JobConfig) -> dict[str, Any]:
    """Plain nested dict of ``cfg`` (JSON serialisable), for run directories and checkpoints."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))
