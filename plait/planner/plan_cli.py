"""Functions behind ``plait plan`` and ``plait simulate`` (the argparse wiring lives in ``plait/cli.py``).

- ``plan_command``: read a job config, build the model's pipeline units (``job_units``: the units and names
  of the job's own model, so a boundary printed here can be pasted into ``parallel.pp.splits``) and their
  analytic costs (``cost_model``: Hugging Face configs from the TOML ``config`` tables or local ``path``
  directories, read with ``transformers.AutoConfig``; no weights), search the layout
  (``search.plan_layout``), print the plan as a table with a ready-to-paste ``[parallel.pp]`` table
  (``pp_snippet``) and write it as JSON (``LayoutChoice.to_dict`` plus the snippet under ``PP_TOML_KEY``;
  ``plan_from_json`` reads it back).
- ``simulate_command``: read such a JSON plan, simulate one iteration (``simulator.simulate`` on the
  plan's schedule, ``LayoutChoice.schedule``) and write the predicted timeline as a Chrome trace and a PNG
  (``plait.train.plots``), the format measured timelines use too (../shared/DESIGN.md, principle 2).

Workload assumed per microbatch (from the config, overridable): ``train.microbatch_size`` sequences of
``data.max_length`` LLM tokens (an upper bound: padding to the longest), each with ``items_per_sample``
items per encoder at the encoder's native size (vision: its ``image_size`` patches; audio: its
``max_source_positions`` frames); ``global_batch_size / microbatch_size`` microbatches per iteration, or the
global batch split into ``--microbatches N`` microbatches of ``ceil(global_batch_size / N)`` sequences
(``split_global_batch``; never more samples than the job's global batch).

Macro-batches (../shared/REFERENCES.md section 3, Entrain): when the job has training data and
``macrobatches`` > 0, ``plan_command`` reads every sample's metadata (the trainer's processing; the model is
built on the meta device, so no weights), draws that many global batches in the loader's order
(``macrobatch.macrobatch_stats``), prints how much each module's total work varies between batches (CV,
min/max, against the ``1 / sqrt(B)`` law) and plans for the **expected** global batch instead of the upper
bound above: per microbatch, ``microbatch_size`` x the mean per-sample encoder tokens, attended pairs and
LLM tokens (``expected_shapes``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from plait.planner.cost_model import (
    DeviceSpec,
    EncoderArch,
    MicrobatchShape,
    arch_from_config,
    unit_costs,
    units_from_configs,
)
from plait.planner.auto_plan import apply_layout_choice
from plait.planner.macrobatch import MacrobatchStats, macrobatch_stats
from plait.planner.pipeline_plan import LAYOUTS
from plait.planner.schedules import build_schedule
from plait.planner.search import LayoutChoice, plan_layout
from plait.planner.simulator import P2PModel, SimResult, StageMemory, simulate
from plait.planner.types import Unit, UnitCost

__all__ = [
    "DEVICES",
    "MODEL_UNITS",
    "PP_TOML_KEY",
    "PlanInputs",
    "build_plan_inputs",
    "dataset_metadata",
    "device_spec",
    "expected_shapes",
    "format_plan",
    "job_units",
    "load_config_for_planning",
    "plan_command",
    "plan_from_json",
    "pp_snippet",
    "rank_peak_memory_bytes",
    "simulate_choice",
    "simulate_command",
    "split_global_batch",
]

DEFAULT_MACROBATCHES = 32

DEVICES = ("h100", "h200", "a100", "cpu")
PP_TOML_KEY = "parallel_pp_toml"
"""Key of the plan JSON (``plan_command``'s ``out_json``) holding the ``[parallel.pp]`` snippet (``pp_snippet``;
null when there is none); every other key is a ``LayoutChoice`` field."""
MODEL_UNITS = "model"
"""``PlanInputs.unit_source`` of units that are the job model's own (``job_units``)."""
_GIB = 2**30


@dataclass(frozen=True)
class PlanInputs:
    """What the layout search needs, derived from a job config.

    Attributes:
        units: pipeline units (``cost_model.units_from_configs``) with the config's freezing flags.
        costs: one ``UnitCost`` per unit on the chosen device.
        model_configs: module -> Hugging Face config or architecture, plus ``"<encoder>.projector"``.
        shapes: module -> ``MicrobatchShape`` of one microbatch.
        microbatches: global microbatches per iteration.
        dtype: training dtype of parameters and activations (``"bfloat16"`` or ``"float32"``).
        unit_source: ``MODEL_UNITS`` (``"model"``) when ``units`` are the job model's own (``job_units``: the
            names ``parallel.pp.splits`` takes); otherwise why the analytic units of
            ``cost_model.units_from_configs`` were used instead.
    """

    units: tuple[Unit, ...]
    costs: tuple[UnitCost, ...]
    model_configs: dict[str, Any]
    shapes: dict[str, MicrobatchShape]
    microbatches: int
    dtype: str
    unit_source: str = MODEL_UNITS


def device_spec(device: str | DeviceSpec) -> DeviceSpec:
    """A ``DeviceSpec`` from a preset name (``DEVICES``) or passed through.

    Raises:
        ValueError: on an unknown name.
    """
    if isinstance(device, DeviceSpec):
        return device
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {DEVICES} or pass a DeviceSpec")
    return getattr(DeviceSpec, device)()


# ----- configs -------------------------------------------------------------------------------------
def _hf_config(path: str | None, fields: dict[str, Any] | None, where: str) -> Any:
    """A ``PretrainedConfig`` from a local directory or a dict with ``model_type``.

    Raises:
        ValueError: on a dict without ``model_type``; FileNotFoundError: on a missing directory.
    """
    from transformers import AutoConfig

    if path is not None:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"{where}: model directory {path} does not exist")
        return AutoConfig.from_pretrained(path)
    fields = dict(fields or {})
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise ValueError(f"{where}.config needs a 'model_type' field, got keys {sorted(fields)}")
    return AutoConfig.for_model(model_type, **fields)


def _encoder_arch(config: Any, downsample: int) -> Any:
    """The encoder architecture of a (possibly composite) config, with feature pooling ``downsample``."""
    sub = getattr(config, "vision_config", None)
    if sub is not None and getattr(config, "model_type", "") not in ("whisper",):
        config = sub
    arch = arch_from_config(config)
    return dataclasses.replace(arch, output_pool=arch.output_pool * downsample) if downsample > 1 else arch


def _tokenizer_size(path: str) -> int | None:
    """Vocabulary size of the tokenizer directory at ``path`` (None when there is none)."""
    if not path or not Path(path).is_dir():
        return None
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(path))


def _model_parts(cfg: Any) -> tuple[dict[str, Any], dict[str, bool], dict[str, int]]:
    """(model_configs, frozen flags, features dropped per item) of a ``JobConfig``'s model section."""
    model = cfg.model
    configs: dict[str, Any] = {}
    frozen: dict[str, bool] = {}
    dropped: dict[str, int] = {}
    meta = _pretrained_meta(model.pretrained) if model.pretrained else {}
    for name, enc in model.encoders.items():
        settings = meta.get(name, {})
        where = f"model.encoders.{name}"
        path = str(Path(model.pretrained) / "encoders" / name / "encoder") if model.pretrained else enc.path
        arch = _encoder_arch(_hf_config(path, enc.config, where), int(settings.get("downsample", enc.downsample)))
        configs[name] = arch
        configs[f"{name}.projector"] = {"kind": settings.get("projector", enc.projector)}
        frozen[name], frozen[f"{name}.projector"] = enc.freeze, enc.freeze_projector
        dropped[name] = arch.prefix_tokens if settings.get("select", enc.select) == "drop_cls" else 0
    fields = dict(model.llm.config or {})
    if model.pretrained is None and model.llm.path is None and "vocab_size" not in fields:
        size = _tokenizer_size(cfg.data.tokenizer)
        if size is not None:
            fields["vocab_size"] = size
    llm_path = str(Path(model.pretrained) / "llm") if model.pretrained else model.llm.path
    configs["llm"] = _hf_config(llm_path, fields, "model.llm")
    frozen["llm"] = model.llm.freeze
    return configs, frozen, dropped


def _pretrained_meta(directory: str) -> dict[str, Any]:
    """Encoder settings stored by ``MultimodalModel.save_pretrained``.

    Raises:
        FileNotFoundError: when ``directory`` has no ``plait_config.json``.
    """
    meta_path = Path(directory) / "plait_config.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"model.pretrained: {directory} is not a plait model directory (no {meta_path.name})")
    return json.loads(meta_path.read_text()).get("encoders", {})


def build_plan_inputs(cfg: Any, device: str | DeviceSpec = "h100", *, microbatches: int | None = None,
                      items_per_sample: int = 1, shapes_override: dict[str, MicrobatchShape] | None = None) -> PlanInputs:
    """Units, costs and workload of the model in a ``JobConfig`` (module docstring for the workload).

    Args:
        cfg: a loaded ``plait.config.schema.JobConfig``.
        device: the accelerator the costs are for (preset name or ``DeviceSpec``).
        microbatches: global microbatches per iteration (default
            ``train.global_batch_size // train.microbatch_size``).
        items_per_sample: modality items per sample and encoder (images per sample, clips per sample).
        shapes_override: per-module microbatch shapes replacing the upper-bound workload (e.g. ``expected_shapes``);
            modules not in it keep the upper bound.

    Raises:
        ValueError: on a bad count or config (named); FileNotFoundError: on a missing model directory.
    """
    spec = device_spec(device)
    if items_per_sample < 1:
        raise ValueError(f"items_per_sample must be >= 1, got {items_per_sample}")
    train = cfg.train
    count = microbatches if microbatches is not None else train.global_batch_size // train.microbatch_size
    if count < 1:
        raise ValueError(f"microbatches must be >= 1, got {count} (train.global_batch_size "
                         f"{train.global_batch_size} / train.microbatch_size {train.microbatch_size})")
    configs, frozen, _ = _model_parts(cfg)
    per_mb = train.microbatch_size
    shapes = {name: MicrobatchShape(tokens=per_mb * items_per_sample * configs[name].item_len)
              for name in configs if name != "llm" and not name.endswith(".projector")}
    length = cfg.data.max_length
    shapes["llm"] = MicrobatchShape(tokens=per_mb * length, seq_len=length)
    shapes.update({name: shape for name, shape in (shapes_override or {}).items() if name in shapes})
    dtype = "float32" if train.dtype == "fp32" or (train.dtype == "auto" and spec.name == "CPU") else "bfloat16"
    units, source = job_units(cfg, configs, frozen)
    costs = unit_costs(units, configs, shapes, spec, dtype)
    return PlanInputs(tuple(units), tuple(costs), configs, shapes, int(count), dtype, source)


class _StandInTokenizer:
    """What composing a model reads of a tokenizer (``registry.compose_model``): its size (the LLM's vocabulary)
    and one distinct id per placeholder token. Enough to build the module tree without the tokenizer files."""

    unk_token_id = -1

    def __init__(self, size: int, placeholders: Sequence[str]) -> None:
        self.size, self.ids = size, {token: i for i, token in enumerate(placeholders)}

    def __len__(self) -> int:
        return self.size

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.ids[token]


def job_units(cfg: Any, configs: dict[str, Any], frozen: dict[str, bool]) -> tuple[tuple[Unit, ...], str]:
    """The pipeline units of a ``JobConfig``'s model, named as the trainer names them, and their source.

    The model is composed as the trainer composes it (``plait.models.registry.build_model``) on the meta
    device: the module tree only, no weights and no memory (tenths of a second; about 1.5 s for an 80-layer
    LLM), with a stand-in for the tokenizer. ``plait.models.units.model_units`` then gives the units by the
    rules the runtime uses: fully qualified names from each family's module-list path
    (``language_model.model.layers.2``, ``encoders.vision.encoder.encoder.layers.0``; the names
    ``parallel.pp.splits`` takes), only the units the selected features reach (no layer after
    ``feature_layer``, no post-norm the selected hidden state skips, e.g. SigLIP's and CLIP's), and the
    frozen-aware flags of the config's freezing.

    Args:
        cfg: the ``JobConfig``; configs, frozen: its parts as ``_model_parts`` reads them.

    Returns:
        ``(units, MODEL_UNITS)``; for a model plait cannot build (an encoder or LLM family without a pipeline
        layout) ``(cost_model.units_from_configs(configs, frozen), reason)``: analytic names such as
        ``llm.layers.2``, which no job can use as ``parallel.pp.splits``.
    """
    from plait.models.registry import build_model, placeholder_of
    from plait.models.units import model_units

    llm = configs["llm"]
    stand_in = _StandInTokenizer(int(getattr(llm, "vocab_size", 0) or 1),
                                 [placeholder_of(enc) for enc in cfg.model.encoders.values()])
    try:
        model = build_model(cfg.model, stand_in, device="meta")
        return model_units(model), MODEL_UNITS
    except ValueError as exc:
        return units_from_configs(configs, frozen), f"plait cannot build this model ({exc})"


# ----- macro-batches ---------------------------------------------------------------------------------
def dataset_metadata(cfg: Any) -> tuple[list[Any], dict[str, Any]]:
    """Every training sample's metadata and the per-sample cost coefficients of a ``JobConfig``'s model.

    The samples are processed exactly as the trainer does (``MultimodalDataset``: same tokenizer, placeholder
    expansion and feature counts; bad records follow ``data.on_error``); the model is built on the meta
    device (no weights, no init), which is all ``plait.train.costs.microbatch_cost_coeffs`` reads.

    Returns:
        ``(metas, coeffs)``: ``SampleMeta`` per usable sample and ``ModuleCostCoeffs`` per encoder and ``"llm"``
        (forward FLOPs x frozen-aware pass factor).

    Raises:
        ValueError: when the job has no ``data.train``, and as the trainer's data pipeline (bad records, no
            usable sample).
    """
    from plait.data.loader import MultimodalDataset
    from plait.models.registry import build_model, build_processor, load_tokenizer
    from plait.train.costs import microbatch_cost_coeffs

    if not cfg.data.train:
        raise ValueError("data.train is not set: macro-batch statistics need the training data")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tokenizer, device="meta")
    processor = build_processor(cfg.model, model, tokenizer, cfg.data.max_length)
    dataset = MultimodalDataset(cfg.data.train, processor, cfg.data.on_error)
    return dataset.meta, microbatch_cost_coeffs(model)


def _item_tokens(arch: Any, placeholders: int, dropped: int) -> int:
    """Tokens an encoder's layers see for one item of ``placeholders`` LLM features: a Whisper-style audio
    encoder always fills its window (``item_len``); vision sees the features plus dropped prefix tokens."""
    if isinstance(arch, EncoderArch) and arch.modality == "audio":
        return int(arch.item_len)
    return int(placeholders) + int(dropped)


def expected_shapes(metas: Sequence[Any], configs: dict[str, Any], dropped: dict[str, int],
                    microbatch_size: int) -> dict[str, MicrobatchShape]:
    """Per-module shape of a microbatch of ``microbatch_size`` samples of the expected global batch.

    For module ``m``: tokens = ``microbatch_size`` x mean over samples of the sample's tokens in ``m``, and
    attended pairs = ``microbatch_size`` x the mean of the sample's per-layer attention pairs (encoder items
    ``n^2``, full attention; LLM ``L (L + 1) / 2``, causal), so linear and quadratic costs are the exact
    expectations; ``seq_len`` is the mean item (encoder) or sequence (LLM) length. An encoder no sample uses
    is left out (its upper-bound shape stays).

    Args:
        metas: ``SampleMeta`` per sample (``length`` and ``items``: ``(encoder, placeholders)``).
        configs: module configs as ``_model_parts`` returns them (encoder ``EncoderArch`` by name).
        dropped: prefix tokens dropped per item, per encoder (``select="drop_cls"``).
        microbatch_size: samples per microbatch.

    Raises:
        ValueError: on an empty ``metas``, a ``microbatch_size`` below 1 or an item of an unknown encoder.
    """
    if not metas or microbatch_size < 1:
        raise ValueError(f"need samples and microbatch_size >= 1, got {len(metas)} samples, {microbatch_size}")
    sums: dict[str, list[float]] = {}  # module -> [tokens, pairs, items]
    for k, meta in enumerate(metas):
        for name, placeholders in meta.items:
            if name not in configs or name == "llm":
                raise ValueError(f"sample {k}: item of unknown encoder {name!r}")
            n = _item_tokens(configs[name], placeholders, dropped.get(name, 0))
            acc = sums.setdefault(name, [0.0, 0.0, 0.0])
            acc[0], acc[1], acc[2] = acc[0] + n, acc[1] + n * n, acc[2] + 1
        acc = sums.setdefault("llm", [0.0, 0.0, 0.0])
        acc[0], acc[1], acc[2] = acc[0] + meta.length, acc[1] + meta.length * (meta.length + 1) / 2, acc[2] + 1
    scale = microbatch_size / len(metas)
    return {name: MicrobatchShape(tokens=max(1, round(tokens * scale)), seq_len=max(1, round(tokens / items)),
                                  attended_pairs=pairs * scale)
            for name, (tokens, pairs, items) in sums.items()}


def _macrobatches(cfg: Any, count: int, stream: TextIO) -> tuple[MacrobatchStats | None, dict[str, MicrobatchShape]]:
    """Macro-batch statistics of the job's training data (printed) and the expected microbatch shapes; no
    statistics (a note instead) when the dataset holds fewer samples than one global batch."""
    metas, coeffs = dataset_metadata(cfg)
    configs, _, dropped = _model_parts(cfg)
    shapes = expected_shapes(metas, configs, dropped, cfg.train.microbatch_size)
    batch = cfg.train.global_batch_size
    if batch > len(metas):
        print(f"macro-batches: {len(metas)} samples, fewer than one global batch of {batch}: no statistics",
              file=stream)
        return None, shapes
    stats = macrobatch_stats(metas, batch, count, coeffs, seed=cfg.train.seed, sampling="loader")
    print(stats.format_table(unit="FLOPs x passes"), file=stream)
    planned = ", ".join(f"{name} {shape.tokens} tokens" for name, shape in shapes.items())
    print(f"planned for the expected global batch: per microbatch of {cfg.train.microbatch_size} samples "
          f"{planned}", file=stream)
    return stats, shapes


# ----- plan ------------------------------------------------------------------------------------------
def _chunk_label(names: Sequence[str]) -> str:
    """``first .. last (n)`` of a stage's unit names for one module, the last without the shared prefix
    (``llm.layers.0 .. layers.7 (8)``)."""
    if len(names) == 1:
        return names[0]
    first, last = names[0].split("."), names[-1].split(".")
    shared = 0
    while shared < min(len(first), len(last)) - 1 and first[shared] == last[shared]:
        shared += 1
    if last[shared:] and last[shared].isdigit() and shared > 0:
        shared -= 1
    return f"{names[0]} .. {'.'.join(last[shared:])} ({len(names)})"


def rank_peak_memory_bytes(choice: LayoutChoice) -> tuple[int, ...]:
    """Per pipeline rank, the most bytes held at once (static bytes of all its stages plus their live
    activations) over one iteration of ``choice``: ``simulate_choice(choice).peak_memory_bytes``. This is what
    a device must hold; ``choice.stage_memory_bytes`` is per stage, so under interleaved 1F1B (several stages
    per rank) or attached encoders their maximum under-reports it."""
    return tuple(simulate_choice(choice).peak_memory_bytes)


def format_plan(choice: LayoutChoice) -> str:
    """The plan as a text table: one row per stage (rank, modules, units, forward and backward ms per
    microbatch, that stage's own peak memory GiB), then the totals with the peak memory per rank (device):
    ``rank_peak_memory_bytes``, the sum over a rank's stages, not the largest stage."""
    plan = choice.plan
    lines = [f"{'stage':>5} {'rank':>4} {'module':<8} {'units':<64} {'F ms':>8} {'B ms':>8} {'stage GiB':>9}"]
    for stage in plan.stages:
        for k, module in enumerate(stage.modules):
            first = k == 0
            lines.append(
                f"{stage.index if first else '':>5} {stage.rank if first else '':>4} {module:<8} "
                f"{_chunk_label(stage.module_units(module)):<64} "
                + (f"{1e3 * choice.stage_forward_s[stage.index]:>8.2f} {1e3 * choice.stage_backward_s[stage.index]:>8.2f} "
                   f"{choice.stage_memory_bytes[stage.index] / _GIB:>9.2f}" if first else ""))
    counts = ", ".join(f"{m} {s}" for m, s in choice.stages_per_module)
    peaks = rank_peak_memory_bytes(choice)
    cap = "no cap" if choice.memory_cap is None else f"cap {choice.memory_cap / _GIB:.1f} GiB"
    lines += [
        f"layout {choice.layout}, DP {choice.dp} x {plan.num_ranks} pipeline ranks = {choice.devices_used} of "
        f"{choice.devices} devices; stages: {counts}",
        f"iteration {1e3 * choice.iteration_s:.2f} ms (pipeline {1e3 * choice.makespan_s:.2f} ms + gradient "
        f"all-reduce {1e3 * choice.grad_sync_s:.2f} ms) with {choice.microbatches_per_replica} of "
        f"{choice.microbatches} microbatches per replica; bubble {100 * choice.bubble_fraction:.1f}%; "
        f"{choice.ratio_to_lower_bound:.2f}x the lower bound {1e3 * choice.lower_bound_s:.2f} ms",
        f"peak memory per rank (device) {max(peaks) / _GIB:.2f} GiB ({cap})"
        + (f"; ranks {' / '.join(f'{p / _GIB:.2f}' for p in peaks)} GiB" if len(peaks) > 1 else "")
        + ("; 'stage GiB' is each stage's own peak, a rank holds all of its stages"
           if plan.num_stages > plan.num_ranks else ""),
    ]
    return "\n".join(lines)


def plan_command(
    config_path: str | Path,
    devices: int,
    out_json: str | Path | None = None,
    *,
    overrides: Sequence[str] = (),
    device: str | DeviceSpec = "h100",
    microbatches: int | None = None,
    items_per_sample: int = 1,
    memory_fraction: float = 0.9,
    frozen_aware: bool = True,
    layouts: Sequence[str] = LAYOUTS,
    dp_degrees: Sequence[int] | None = None,
    dp_link_Bps: float | None = None,
    rel_tol: float = 0.0,
    macrobatches: int = 0,
    virtual_stages: Sequence[int] = (1, 2, 4),
    attach_encoders: bool = True,
    out: TextIO | None = None,
) -> LayoutChoice:
    """``plait plan``: choose the pipeline layout of a job for ``devices`` accelerators, print it with its
    ``[parallel.pp]`` table (``pp_snippet``, or why there is none), save it. The job file is read with
    ``load_config_for_planning``: its own ``[parallel.pp]`` table and ``parallel.dp`` are replaced by the plan,
    not checked.

    Args:
        config_path: TOML job file; overrides: dotted ``--section.key=value`` overrides.
        devices: accelerators available.
        out_json: where to write the plan JSON (``LayoutChoice.to_dict`` and ``PP_TOML_KEY``; parents
            created); None: do not write.
        device: accelerator preset (``DEVICES``) or ``DeviceSpec``; its link is the stage-to-stage P2P model.
        microbatches: global microbatches per step: the job's global batch split into this many microbatches of
            ``ceil(train.global_batch_size / microbatches)`` samples (``split_global_batch``; at most
            ``train.global_batch_size``); None: ``global_batch_size / microbatch_size`` of ``microbatch_size``.
        items_per_sample: workload (``build_plan_inputs``).
        memory_fraction: fraction of the device memory a stage may use (the rest: CUDA context, workspaces).
        dp_degrees: DP degrees to search (``plait plan --dp``), each in ``1..min(devices, microbatches)``;
            None: the divisors of ``devices`` in that range.
        frozen_aware, layouts, rel_tol, virtual_stages, attach_encoders: as
            ``search.plan_layout`` (by default interleaved 1F1B with 2 or 4 LLM stages per rank and encoders on
            the first LLM rank are searched too: jobs run them, ``[parallel.pp] virtual_stages / attach_encoders``).
        dp_link_Bps: bandwidth (B/s) of the data-parallel gradient all-reduce; None: not modelled.
        macrobatches: global batches drawn from the training data for the macro-batch statistics (module
            docstring; ``DEFAULT_MACROBATCHES`` is a good count); the plan is then for the expected global
            batch. 0, or a job without ``data.train``: no statistics, upper-bound workload. Off by default
            because it processes the training set as the trainer does (about 30 ms per sample on a CPU core).
        out: text stream for the table (default stdout).

    Returns:
        The ``LayoutChoice``.

    Raises:
        ValueError: on bad arguments (``--microbatches`` above the global batch's samples, ``--dp`` out of range:
            named) or configs, or when no layout fits memory; FileNotFoundError: on a missing config file or
            model directory.
    """
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    if isinstance(macrobatches, bool) or not isinstance(macrobatches, int) or macrobatches < 0:
        raise ValueError(f"macrobatches must be an integer >= 0, got {macrobatches!r}")
    spec = device_spec(device)
    stream = out or sys.stdout
    cfg, replaced = load_config_for_planning(config_path, overrides)
    if replaced:
        print(f"plait plan: the job's {replaced} is not checked or used: the plan replaces it", file=stream)
    cfg = split_global_batch(cfg, microbatches)
    microbatches = None if microbatches is None else int(microbatches)
    _check_dp_degrees(dp_degrees, devices,
                      microbatches or max(1, cfg.train.global_batch_size // cfg.train.microbatch_size))
    expected = None
    if macrobatches and cfg.data.train:
        _, expected = _macrobatches(cfg, macrobatches, stream)
    inputs = build_plan_inputs(cfg, spec, microbatches=microbatches, items_per_sample=items_per_sample,
                               shapes_override=expected)
    dp_link = None if dp_link_Bps is None else P2PModel(spec.link_latency, dp_link_Bps)
    choice = plan_layout(
        inputs.units, inputs.costs, devices, microbatches=inputs.microbatches, frozen_aware=frozen_aware,
        memory_cap=memory_fraction * spec.memory_bytes, p2p=P2PModel(spec.link_latency, spec.link_bandwidth),
        dp_link=dp_link, layouts=layouts, dp_degrees=dp_degrees, rel_tol=rel_tol, dtype=inputs.dtype,
        virtual_stages=virtual_stages, attach_encoders=attach_encoders,
    )
    print(f"plait plan: {config_path} on {devices} x {spec.name}, {inputs.microbatches} microbatches of "
          f"{cfg.train.microbatch_size} samples (global batch {cfg.train.global_batch_size})", file=stream)
    print(format_plan(choice), file=stream)
    snippet, why = pp_snippet(cfg, choice, inputs.units, inputs.unit_source)
    if snippet is None:
        print(f"no [parallel.pp] snippet: {why}", file=stream)
    else:
        print(f"to run this plan, put this table in the job file:\n{snippet}", end="", file=stream)
    if out_json is not None:
        path = Path(out_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**choice.to_dict(), PP_TOML_KEY: snippet}, indent=2))
        print(f"plan written to {path}", file=stream)
    return choice


def load_config_for_planning(config_path: str | Path, overrides: Sequence[str] = ()) -> tuple[Any, str]:
    """The job config ``plait plan`` plans for: the TOML file with its ``--section.key=value`` overrides, read and
    validated as ``plait.config.loader.load_config`` does, except that the job's ``[parallel.pp]`` table and
    ``parallel.dp`` are reset to their defaults first: the plan replaces them, so a table written for another
    model or world size (e.g. ``attach_encoders = true`` on an LLM-only job) must not stop the planning.

    Returns:
        ``(JobConfig, replaced)``: ``replaced`` names what was reset (``"[parallel.pp] table"``,
        ``"parallel.dp = 2"``, both joined by ``" and "``), ``""`` when the job set neither.

    Raises:
        FileNotFoundError: when the file does not exist; ValueError: as ``load_config`` (TOML syntax, unknown
            keys, wrong types or invalid values outside ``[parallel.pp]``, named by dotted key).
    """
    from plait.config.loader import config_from_dict, read_config_data, validate

    data = read_config_data(config_path, overrides)
    parallel = data.get("parallel")
    replaced = []
    if isinstance(parallel, dict):
        if parallel.pop("pp", None):
            replaced.append("[parallel.pp] table")
        if parallel.get("dp", 0) not in (0, 1):
            replaced.append(f"parallel.dp = {parallel['dp']}")
        parallel.pop("dp", None)
    cfg = config_from_dict(data)
    validate(cfg)
    return cfg, " and ".join(replaced)


def split_global_batch(cfg: Any, microbatches: int | None) -> Any:
    """``cfg`` with its global batch split into ``microbatches`` microbatches (``plait plan --microbatches``).

    ``--microbatches N`` plans the job's own global batch (``train.global_batch_size`` = ``G`` samples per step)
    cut into ``N`` microbatches of ``ceil(G / N)`` samples, as ``parallel.pp.microbatches`` cuts it at run time;
    it never adds samples. The returned copy has ``train.microbatch_size = ceil(G / N)``; None returns ``cfg``
    (``G / train.microbatch_size`` microbatches).

    Raises:
        ValueError: naming ``--microbatches`` when ``N`` is not an integer in ``1..G`` (a microbatch needs at least
            one sample).
    """
    if microbatches is None:
        return cfg
    train = cfg.train
    if isinstance(microbatches, bool) or int(microbatches) != microbatches or not \
            1 <= microbatches <= train.global_batch_size:
        raise ValueError(
            f"--microbatches {microbatches}: must be in 1..{train.global_batch_size}, the samples of the job's global "
            f"batch (train.global_batch_size {train.global_batch_size}, train.microbatch_size "
            f"{train.microbatch_size}: {max(1, train.global_batch_size // train.microbatch_size)} microbatches); "
            "the planner splits that global batch, it does not add samples: raise train.global_batch_size "
            "(--train.global_batch_size=...) to plan a larger one")
    out = copy.deepcopy(cfg)
    out.train.microbatch_size = -(-train.global_batch_size // int(microbatches))
    return out


def _check_dp_degrees(dp_degrees: Sequence[int] | None, devices: int, microbatches: int) -> None:
    """``plan_command``'s DP degrees (``plait plan --dp``) against the devices and microbatches.

    Raises:
        ValueError: naming ``--dp`` for a degree outside ``1..min(devices, microbatches)``.
    """
    top = min(devices, microbatches)
    for d in dp_degrees or ():
        if isinstance(d, bool) or int(d) != d or not 1 <= d <= top:
            raise ValueError(f"--dp {d}: the data-parallel degree must be in 1..{top} (at most --devices {devices} "
                             f"and the {microbatches} microbatches per step: each replica needs a microbatch)")


def plan_from_json(text: str) -> LayoutChoice:
    """The ``LayoutChoice`` of a plan JSON written by ``plan_command`` (its ``PP_TOML_KEY`` entry dropped).

    Raises:
        ValueError: when the text is not JSON, or not such a plan: missing or unknown keys (saying when it looks
            like a profile or a Chrome trace), or as ``LayoutChoice.from_dict``.
    """
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"a plan is a JSON object, got {type(data).__name__}")
    data.pop(PP_TOML_KEY, None)
    fields = dataclasses.fields(LayoutChoice)
    missing = [f.name for f in fields
               if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    unknown = sorted(set(data) - {f.name for f in fields})
    if missing or unknown:
        kind = "a profile (plait profile --out)" if {"format", "key", "measurements"} <= set(data) else (
            "a Chrome trace (e.g. timeline.json)" if "traceEvents" in data else "")
        raise ValueError(("it looks like " + kind + "; " if kind else "")
                         + f"a plan has the keys of LayoutChoice; missing {missing[:6]}"
                         + (f", unknown {unknown[:6]}" if unknown else ""))
    return LayoutChoice.from_dict(data)


# ----- [parallel.pp] snippet ---------------------------------------------------------------------------------
def pp_snippet(cfg: Any, choice: LayoutChoice, units: Sequence[Unit],
               unit_source: str = MODEL_UNITS) -> tuple[str | None, str]:
    """A ready-to-paste ``[parallel.pp]`` TOML table that makes the job run ``choice``, or None and why not.

    The table is ``auto_plan.apply_layout_choice``'s ``parallel.pp`` (degree, layout, stages per module,
    schedule, microbatches per replica, and ``splits`` for the modules whose cost-balanced boundaries are not
    the even split by unit count, ``virtual_stages`` and ``attach_encoders`` when the plan interleaves),
    written as TOML, under a comment line giving the rest of ``apply_layout_choice``'s config: ``parallel.dp``
    (to set in the job's ``[parallel]`` table when the plan has several replicas; the table describes one
    pipeline replica, ``microbatches`` per replica) and ``parallel.plan = "manual"``. There is one only for
    stage placement that ``[parallel.pp]`` can express (``apply_layout_choice`` accepts it; a one-rank plan is
    ``degree = 1``, no pipeline parallelism) and units named as the model names them (``unit_source`` is
    ``MODEL_UNITS``, see ``job_units``).

    Args:
        cfg: the ``JobConfig`` the plan is for; choice: the plan; units: the units it was searched over.
        unit_source: ``PlanInputs.unit_source``.

    Returns:
        ``(toml_text, "")`` or ``(None, reason)``.
    """
    if unit_source != MODEL_UNITS:
        return None, f"the unit names are not the model's: {unit_source}"
    try:
        pp = apply_layout_choice(cfg, choice, units).parallel.pp
    except ValueError as exc:
        return None, f"[parallel.pp] cannot express this plan: {exc}"
    fields: dict[str, Any] = {"degree": pp.degree}
    if pp.degree > 1:
        fields.update(layout=pp.layout, stages=pp.stages, schedule=pp.schedule, microbatches=pp.microbatches)
        if pp.virtual_stages != 1:
            fields["virtual_stages"] = pp.virtual_stages
        if pp.attach_encoders:
            fields["attach_encoders"] = True
        if pp.splits:
            fields["splits"] = pp.splits
    body = "".join(f"{k} = {_toml_value(v)}\n" for k, v in fields.items())
    return _snippet_head(choice.dp, pp.degree) + "[parallel.pp]\n" + body, ""


def _snippet_head(dp: int, degree: int) -> str:
    """The comment line above a ``[parallel.pp]`` snippet: the replicas and what to set in ``[parallel]``."""
    pipeline = f"a pipeline of {degree} ranks" if degree > 1 else "no pipeline (degree = 1: the whole model per rank)"
    if dp == 1:
        return f"# plait plan: one replica, {pipeline}; parallel.dp = 1, parallel.plan = \"manual\"\n"
    return (f"# plait plan: {dp} data-parallel replicas ({dp * degree} processes), each {pipeline}: also set "
            f"parallel.dp = {dp} and parallel.plan = \"manual\" in [parallel]\n")


def _toml_value(value: Any) -> str:
    """TOML text of a bool, an int, a string, a list or a dict of them (inline table).

    Raises:
        ValueError: on another type.
    """
    if not isinstance(value, (bool, int, str, list, tuple, dict)):
        raise ValueError(f"no TOML form for {value!r} here")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string (ASCII, escaped) is a TOML basic string
    if isinstance(value, dict):
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items())
        return f"{{ {items} }}" if items else "{}"
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"


def _toml_key(key: str) -> str:
    """A bare key when TOML allows one (letters, digits, ``_``, ``-``), else a quoted key."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


# ----- simulate ------------------------------------------------------------------------------------------
def simulate_choice(choice: LayoutChoice) -> SimResult:
    """Simulate one iteration of ``choice``'s busiest replica from the per-stage costs it carries."""
    plan = choice.plan
    costs = {}
    for s in range(plan.num_stages):
        costs[(s, "F")] = choice.stage_forward_s[s]
        costs[(s, "B")] = choice.stage_backward_s[s]
    memory = {s: StageMemory(int(choice.stage_static_bytes[s]), int(choice.stage_activation_bytes[s]))
              for s in range(plan.num_stages)}
    boundary = dict(enumerate(choice.stage_boundary_bytes))
    schedule = build_schedule(plan, choice.schedule, choice.microbatches_per_replica)  # 1F1B or interleaved
    return simulate(schedule, costs, p2p=choice.p2p, boundary_bytes=boundary, memory=memory)


def simulate_command(plan_json: str | Path, out_dir: str | Path, *, out: TextIO | None = None) -> dict[str, Path]:
    """``plait simulate``: the predicted timeline of a plan written by ``plan_command``.

    Writes ``<out_dir>/timeline.json`` (Chrome trace: open in https://ui.perfetto.dev) and
    ``<out_dir>/timeline.png`` (Gantt chart), one track per pipeline rank of one replica.

    Returns:
        ``{"trace": path, "png": path}``.

    Raises:
        FileNotFoundError: when ``plan_json`` does not exist; ValueError: naming the file when it is not a plan
            JSON written by ``plan_command`` (``plait plan --out``), e.g. a profile or a ``timeline.json``.
    """
    from plait.train.plots import plot_timeline, write_chrome_trace

    path = Path(plan_json)
    if not path.is_file():
        raise FileNotFoundError(f"plan file {path} does not exist")
    try:
        choice = plan_from_json(path.read_text())
        result = simulate_choice(choice)
    except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError) as exc:  # not JSON, not a plan
        raise ValueError(f"--plan {path} is not a plan JSON written by `plait plan --out` "
                         f"({type(exc).__name__}: {exc})") from exc
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out-dir {folder} exists and is not a folder")
    trace = write_chrome_trace(result.events, folder / "timeline.json", label="predicted")
    title = f"predicted: {choice.layout}, DP {choice.dp}, {choice.microbatches_per_replica} microbatches per replica"
    png = plot_timeline(result.events, folder / "timeline.png", title=title)
    print(f"plait simulate: makespan {1e3 * result.makespan_s:.2f} ms, bubble "
          f"{100 * result.mean_bubble_fraction:.1f}%, peak memory {max(result.peak_memory_bytes) / _GIB:.2f} GiB; "
          f"wrote {trace} and {png}", file=out or sys.stdout)
    return {"trace": trace, "png": png}
