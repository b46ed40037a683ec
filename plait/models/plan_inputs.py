"""The planner's inputs of a job's model: its pipeline units, their analytic costs and one microbatch's workload
(:func:`build_plan_inputs`), from the job's ``[model]`` tables (Hugging Face configs from the TOML ``config``
tables or local ``path`` directories, read with ``transformers.AutoConfig``; no weights) and the model plait builds
from them on the meta device (:func:`job_units`).

Workload assumed per microbatch: ``train.microbatch_size`` sequences of ``data.max_length`` LLM tokens (an upper
bound: padding to the longest), each with ``items_per_sample`` items per encoder at the encoder's native size
(vision: its ``image_size`` patches; a native-resolution tower with a patch merger, Qwen2.5-VL's or Qwen3-VL's: the
largest image its job's processor keeps, :func:`max_pixels`, else one attention window; audio: its
``max_source_positions`` frames).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.config.schema import EncoderConfig
from plait.data.chat_template import missing_pretrained
from plait.models.hf import NoPipelineLayout, tp_refusal
from plait.models.families import family_of, tower_config
from plait.models.families.base import EncoderFamily
from plait.models.multimodal import PLAIT_CONFIG
from plait.models.registry import build_model, placeholder_of
from plait.models.units import model_units
from plait.planner.cost.arch import EncoderArch, arch_from_config, units_from_configs
from plait.planner.cost.analytic import unit_costs
from plait.planner.cost.types import DeviceSpec, MicrobatchShape
from plait.planner.types import LLM_MODULE, Unit, UnitCost

__all__ = ["DEVICES", "MODEL_UNITS", "PlanInputs", "build_plan_inputs", "device_spec", "encoder_arch", "job_units",
           "max_pixels", "model_parts", "pixel_shuffle_patches", "plan_configs"]

MODEL_UNITS = "model"
"""``PlanInputs.unit_source`` of units that are the job model's own (:func:`job_units`)."""

DEVICES = ("h100", "h200", "a100", "cpu")


@dataclass(frozen=True)
class PlanInputs:
    """What the layout search needs, derived from a job config.

    Attributes:
        units: pipeline units (``arch.units_from_configs``) with the config's freezing flags.
        costs: one ``UnitCost`` per unit on the chosen device.
        model_configs: ``"llm"`` -> its Hugging Face config, each encoder -> its ``EncoderArch`` (:func:`encoder_arch`),
            plus ``"<encoder>.projector"``.
        shapes: module -> ``MicrobatchShape`` of one microbatch.
        microbatches: global microbatches per iteration.
        dtype: training dtype of parameters and activations (``"bfloat16"`` or ``"float32"``).
        unit_source: ``MODEL_UNITS`` (``"model"``) when ``units`` are the job model's own (``job_units``: the
            names ``parallel.pp.splits`` takes); otherwise why the analytic units of
            ``arch.units_from_configs`` were used instead.
        tp_refusal: why plait's tensor parallelism refuses this model (``models.hf.tp_refusal``, the runtime's
            rule: e.g. Qwen3's q/k norms), ``""`` when it can split it: the search then offers no TP degree above 1.
    """

    units: tuple[Unit, ...]
    costs: tuple[UnitCost, ...]
    model_configs: dict[str, Any]
    shapes: dict[str, MicrobatchShape]
    microbatches: int
    dtype: str
    unit_source: str = MODEL_UNITS
    tp_refusal: str = ""


def device_spec(device: str | DeviceSpec) -> DeviceSpec:
    """A ``DeviceSpec`` from a preset name (``DEVICES``) or passed through.

    Raises:
        ValueError: on an unknown name.
    """
    if isinstance(device, DeviceSpec):
        return device
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)} (Python callers may also "
                         "pass a DeviceSpec of their own)")
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


def _family(config: Any) -> tuple[EncoderFamily | None, Any]:
    """(family, the tower's own config) of a (possibly composite) encoder config; family None for a type plait
    has no family of (then a composite config's ``vision_config`` is the tower's)."""
    tower = tower_config(config)
    model_type = tower.get("model_type", "") if isinstance(tower, dict) else getattr(tower, "model_type", "")
    family = family_of(str(model_type or ""))
    if family is None:
        sub = tower.get("vision_config") if isinstance(tower, dict) else getattr(tower, "vision_config", None)
        tower = tower if sub is None else sub
    return family, tower


def encoder_arch(config: Any, downsample: int = 1) -> EncoderArch:
    """The planner's ``EncoderArch`` of an encoder config (object or dict; a full checkpoint's config gives its
    tower's), with feature pooling ``downsample``: the family's facts (``EncoderFamily.arch_fields``); a type of no
    plait family is read by the planner's generic reader (``arch_from_config``). An ``EncoderArch`` passes through.

    Raises:
        ValueError: on a missing field, or a config that is no encoder's.
    """
    if isinstance(config, EncoderArch):
        arch = config
    else:
        family, tower = _family(config)
        arch = EncoderArch(**family.arch_fields(tower)) if family is not None else arch_from_config(tower)
        if not isinstance(arch, EncoderArch):
            raise ValueError(f"config {getattr(tower, 'model_type', '')!r} is not an encoder's")
    return dataclasses.replace(arch, output_pool=arch.output_pool * downsample) if downsample > 1 else arch


def plan_configs(configs: Mapping[str, Any]) -> dict[str, Any]:
    """The planner's ``model_configs`` of ``configs`` (module -> config): each encoder's config (a key other than
    ``"llm"`` and ``"<encoder>.projector"``) as its :func:`encoder_arch`, the others as they are.

    Raises:
        ValueError: as :func:`encoder_arch`.
    """
    return {key: value if key == LLM_MODULE or key.endswith(".projector") else encoder_arch(value)
            for key, value in configs.items()}


def pixel_shuffle_patches(downsample: int) -> int:
    """Encoder patches per feature of a pixel shuffle (``EncoderFamily.pixel_shuffle``, InternVL's), whose
    ``downsample`` ``d`` (``1 / downsample_ratio``) turns each ``d x d`` block of patches into one feature ``d^2``
    times as wide: ``d^2`` (also the width factor of the projector's input)."""
    return downsample ** 2


def _tokenizer_size(path: str) -> int | None:
    """Vocabulary size of the tokenizer directory at ``path`` (``data.tokenizer``; None when it is not set).

    Raises:
        FileNotFoundError: when ``path`` is set but is no directory (a relative path read from another working
            directory would otherwise plan the LLM's head with the config's default vocabulary, silently).
    """
    if not path:
        return None
    if not Path(path).is_dir():
        raise FileNotFoundError(f"data.tokenizer {path} is not a directory (relative paths are read from the working "
                                f"directory, {Path.cwd()}): the plan needs its vocabulary size for the LLM's head")
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(path))


def model_parts(cfg: Any) -> tuple[dict[str, Any], dict[str, bool], dict[str, int]]:
    """(model_configs, frozen flags, features dropped per item) of a ``JobConfig``'s model section."""
    model = cfg.model
    configs: dict[str, Any] = {}
    frozen: dict[str, bool] = {}
    dropped: dict[str, int] = {}
    meta = _pretrained_meta(model.pretrained) if model.pretrained else {}
    branches = dict(model.encoders)  # a pretrained model's branch without a table of the job: the defaults, as trained
    branches.update({name: EncoderConfig(modality=m.get("modality", "image")) for name, m in meta.items()
                     if name not in branches})
    for name, enc in branches.items():
        settings = meta.get(name, {})
        where = f"model.encoders.{name}"
        path = str(Path(model.pretrained) / "encoders" / name / "encoder") if model.pretrained else enc.path
        hf_config = _hf_config(path, enc.config, where)
        downsample = int(settings.get("downsample", enc.downsample))
        family, _ = _family(hf_config)
        shuffled = downsample > 1 and family is not None and family.pixel_shuffle
        pooled = downsample > 1 and family is not None and getattr(family, "average_pool", False)  # 2-D blocks
        arch = encoder_arch(hf_config, pixel_shuffle_patches(downsample) if shuffled or pooled else downsample)
        largest = max_pixels(enc.processor)
        if arch.merger != (0, 0) and largest:  # native-resolution towers: an item is its largest image
            arch = dataclasses.replace(arch, item_len=largest // arch.patch[1] ** 2)
        configs[name] = arch
        configs[f"{name}.projector"] = {"kind": settings.get("projector", enc.projector)}
        if shuffled:
            configs[f"{name}.projector"]["in_dim"] = arch.hidden * pixel_shuffle_patches(downsample)
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


def max_pixels(processor: Mapping[str, Any]) -> int:
    """The largest image (pixels) a job's ``[model.encoders.<name>.processor]`` table lets a native-resolution
    processor keep (``max_pixels``, or ``size.longest_edge`` as transformers' Qwen2-VL processors name it); 0 when it
    sets neither. The planner sizes such a tower's item as that image (``max_pixels / patch^2`` patches), an upper
    bound as ``data.max_length`` is for the text.

    Raises:
        ValueError: on a value that is not a positive integer (naming the field).
    """
    size = processor.get("size")
    value = processor.get("max_pixels", size.get("longest_edge") if isinstance(size, Mapping) else None)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"processor.max_pixels must be a positive integer (pixels), got {value!r}")
    return value


def _pretrained_meta(directory: str) -> dict[str, Any]:
    """Encoder settings stored by ``MultimodalModel.save_pretrained``.

    Raises:
        FileNotFoundError: when ``directory`` has no ``plait_config.json``.
    """
    if not Path(directory).is_dir():
        raise FileNotFoundError(missing_pretrained(directory))
    meta_path = Path(directory) / PLAIT_CONFIG
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
    configs, frozen, _ = model_parts(cfg)
    per_mb = train.microbatch_size
    shapes = {name: MicrobatchShape(tokens=per_mb * items_per_sample * configs[name].item_len)
              for name in configs if name != "llm" and not name.endswith(".projector")}
    length = cfg.data.max_length
    shapes["llm"] = MicrobatchShape(tokens=per_mb * length, seq_len=length)
    shapes.update({name: shape for name, shape in (shapes_override or {}).items() if name in shapes})
    on_cpu = spec.name.split(" ")[0] == "CPU"  # the preset and a host CPU measured (plait.measure.host_costs.host_cpu)
    dtype = "float32" if train.dtype == "fp32" or (train.dtype == "auto" and on_cpu) else "bfloat16"
    units, source, refusal = job_units(cfg, configs, frozen)
    costs = unit_costs(units, configs, shapes, spec, dtype)
    return PlanInputs(tuple(units), tuple(costs), configs, shapes, int(count), dtype, source, refusal)


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


def job_units(cfg: Any, configs: dict[str, Any], frozen: dict[str, bool]) -> tuple[tuple[Unit, ...], str, str]:
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
        cfg: the ``JobConfig``; configs, frozen: its parts as ``model_parts`` reads them.

    Returns:
        ``(units, MODEL_UNITS, tp_refusal)`` (``models.hf.tp_refusal`` of the built model: why plait's tensor
        parallelism refuses it, or ``""``); for a model plait cannot cut into units (an encoder or LLM family
        without a pipeline layout: ``NoPipelineLayout``) ``(arch.units_from_configs(configs, frozen), reason,
        reason)``: analytic names such as ``llm.layers.2``, which no job can use as ``parallel.pp.splits``.

    Raises:
        ValueError: for a model table the trainer would refuse (an unknown config field, a bad value), named as
            ``build_model`` names it: checked before anything is planned.
    """
    llm = configs["llm"]
    stand_in = _StandInTokenizer(int(getattr(llm, "vocab_size", 0) or 1),
                                 [placeholder_of(enc) for enc in cfg.model.encoders.values()])
    try:
        model = build_model(cfg.model, stand_in, device="meta")
        units = model_units(model)
    except NoPipelineLayout as exc:
        reason = f"plait cannot build this model ({exc})"
        return units_from_configs(configs, frozen), reason, reason
    return units, MODEL_UNITS, tp_refusal(model.language_model, {n: b.encoder for n, b in model.encoders.items()})
