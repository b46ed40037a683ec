"""The encoder families plait knows, one module each (:class:`~plait.models.families.base.EncoderFamily`: tower
class, pipeline layout, tensor-parallel plan, tower call, feature count, processor defaults and checks, input
check, video encoding, the planner's architecture facts).

Adding a family: write ``families/<family>.py`` with a ``FAMILY`` instance of a
:class:`~plait.models.families.base.VisionFamily` or :class:`~plait.models.families.base.AudioFamily` subclass, and
list it in :data:`FAMILIES`.
"""

from __future__ import annotations

from typing import Any

from plait.models.families import (clip, internvl, pixtral, qwen2_5_vl, qwen2_audio, qwen3_vl, siglip, siglip2, vit,
                                   whisper)
from plait.models.families import qwen2_5_omni
from plait.models.families import voxtral
from plait.models.families import qwen3_vl_moe
from plait.models.families import qwen3_omni_moe
from plait.models.families.base import AudioFamily, EncoderFamily, VisionFamily

__all__ = ["FAMILIES", "family_of", "family_of_layer", "encoder_family", "supported_types", "tower_config"]

FAMILIES: tuple[EncoderFamily, ...] = (
    siglip.FAMILY,
    clip.FAMILY,
    vit.FAMILY,
    siglip2.FAMILY,
    pixtral.FAMILY,
    internvl.FAMILY,
    qwen2_5_vl.FAMILY,
    qwen3_vl.FAMILY,
    whisper.FAMILY,
    qwen2_audio.FAMILY,
    qwen2_5_omni.VISION,
    qwen2_5_omni.AUDIO,
    voxtral.FAMILY,
    qwen3_vl_moe.FAMILY,
    qwen3_omni_moe.VISION,
    qwen3_omni_moe.AUDIO,
)
"""Every encoder family, one line each."""

_BY_TYPE: dict[str, EncoderFamily] = {t: family for family in FAMILIES for t in family.model_types}
_BY_LAYER: dict[str, EncoderFamily] = {family.layer_class: family for family in FAMILIES if family.layer_class}
_GENERIC: dict[str, EncoderFamily] = {"image": VisionFamily(), "audio": AudioFamily()}


def family_of(model_type: str, modality: str | None = None) -> EncoderFamily | None:
    """The family of a config ``model_type`` (of ``modality`` when given); None for an unknown one."""
    family = _BY_TYPE.get(model_type)
    if family is None or (modality is not None and family.modality != modality):
        return None
    return family


def family_of_layer(class_name: str) -> EncoderFamily | None:
    """The family whose tower layers are of class ``class_name`` when it calls them its own way
    (``EncoderFamily.layer_class``); None otherwise."""
    return _BY_LAYER.get(class_name)


def encoder_family(model_type: str, modality: str) -> EncoderFamily:
    """The family of ``model_type``, or for an unknown one the plain ViT (no CLS token) or Whisper defaults of
    ``modality`` (``"image"`` or ``"audio"``)."""
    return family_of(model_type, modality) or _GENERIC["image" if modality == "image" else "audio"]


def supported_types(modality: str, layout: bool = False, tp: bool = False) -> list[str]:
    """The sorted ``model_type`` values of ``modality``'s families (with a pipeline layout or a tensor-parallel plan
    when asked; ``modality`` ``""``: every modality)."""
    return sorted(t for t, f in _BY_TYPE.items() if (not modality or f.modality == modality)
                  and (not layout or f.layout is not None) and (not tp or f.tp_plan is not None))


def tower_config(config: Any) -> Any:
    """The tower's own config of a (possibly composite) encoder config, a config object or a plain dict: a full
    checkpoint's ``vision_config``/``audio_config`` for the families whose ``model_types`` name one, else
    ``config`` itself."""
    model_type = config.get("model_type", "") if isinstance(config, dict) else getattr(config, "model_type", "")
    family = family_of(model_type)
    where = None if family is None else family.model_types.get(model_type)
    if where is None:
        return config
    sub = config.get(where) if isinstance(config, dict) else getattr(config, where, None)
    return config if sub is None else sub
