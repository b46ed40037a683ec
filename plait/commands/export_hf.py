"""``plait export``: a trained plait model back as a Hugging Face multimodal checkpoint.

``plait export --run runs/llava15 --format llava --out llava-trained`` reads ``<run>/final`` (or a ``final/``
folder itself: the model, ``tokenizer/``, ``processors/<branch>/``), merges LoRA adapters into their base weights,
and writes a ``LlavaForConditionalGeneration`` / ``Qwen2AudioForConditionalGeneration`` /
``Qwen2_5_VLForConditionalGeneration`` folder with its processor (``LlavaProcessor`` / ``Qwen2AudioProcessor`` /
``Qwen2_5_VLProcessor``: the branch's image processor or feature extractor, the tokenizer and its chat template),
which ``transformers``' ``from_pretrained`` and ``AutoProcessor`` load (``Qwen2_5_VLProcessor`` where torchvision is
installed, for its video processor; its image processor and tokenizer load without). Qwen2.5-VL's projector is folded
into the tower's merger (:mod:`plait.models.hf_io`). A composite the class
cannot hold (two encoders, a projector LLaVA lacks, ...) is refused naming the difference
(:func:`plait.models.hf_io.check_exportable`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import transformers
from safetensors.torch import load_file

from plait.data.sources import path_note
from plait.models.file_modes import share_saved_files
from plait.models.generation import with_stop_tokens
from plait.models.gemma3 import GEMMA3_TOKENS
from plait.models.hf_io import (HF_FORMATS, QWEN_VL_FORMATS, QWEN_VL_TOKENS, REFUSED_EXPORTS, check_exportable,
                                hf_from_composite, merge_adapters, save_hf_processor)
from plait.models.hf_io_omni import THINKERS, check_thinker_exportable, save_thinker_processor, thinker_from_composite
from plait.models.hf_io_voxtral import VOXTRAL_CLASS, check_voxtral_exportable, save_voxtral_processor, \
    voxtral_from_composite
from plait.models.multimodal import PLAIT_CONFIG, MultimodalModel

__all__ = ["export_command", "export_checkpoint", "final_folder", "torchvision_note", "VIDEO_PROCESSOR_FORMATS"]


def export_command(run: str | Path, fmt: str, out: str | Path | None = None) -> int:
    """``plait export``: :func:`export_checkpoint`, then print where it went. Returns 0.

    Raises:
        ValueError, FileNotFoundError: as :func:`export_checkpoint`.
    """
    folder = export_checkpoint(run, fmt, out)
    print(f"plait: exported {final_folder(run)} as {HF_FORMATS[fmt].model_class} to {folder} "
          f"(transformers: {HF_FORMATS[fmt].model_class}.from_pretrained, AutoProcessor.from_pretrained)", flush=True)
    note = torchvision_note(fmt)
    if note:
        print(f"plait: {note}", flush=True)
    return 0


VIDEO_PROCESSOR_FORMATS = (*QWEN_VL_FORMATS, *THINKERS)
"""The formats whose transformers processor class holds a video processor (``Qwen2VLVideoProcessor``,
``Qwen3VLVideoProcessor``), which transformers implements with torchvision only: ``AutoProcessor`` loads their
export where torchvision is installed. Every image processor has a PIL class (``Qwen2VLImageProcessorPil``,
``CLIPImageProcessorPil``, ``Gemma3ImageProcessorPil``, ...) that ``AutoImageProcessor`` takes without torchvision, so
the other formats' processors (LLaVA, Qwen2-Audio, Gemma 3, Voxtral) load anywhere."""


def torchvision_note(fmt: str) -> str:
    """What ``plait export`` says after writing ``fmt`` where torchvision is not installed and ``fmt``'s processor
    needs it (:data:`VIDEO_PROCESSOR_FORMATS`); ``""`` otherwise."""
    if fmt not in VIDEO_PROCESSOR_FORMATS or importlib.util.find_spec("torchvision") is not None:
        return ""
    return (f"{HF_FORMATS[fmt].processor_class} needs torchvision for its video processor (transformers has no other): "
            "install torchvision where AutoProcessor loads this folder; AutoImageProcessor and AutoTokenizer load "
            "it without")


def final_folder(run: str | Path) -> Path:
    """The trained model folder of ``run``: ``run`` itself when it holds ``plait_config.json``, else ``run/final``.

    Raises:
        FileNotFoundError: naming what is missing.
    """
    root = Path(run)
    if not root.is_dir():
        raise FileNotFoundError(f"--run {root}: no such folder{path_note(root)}")
    for folder in (root, root / "final"):
        if (folder / PLAIT_CONFIG).is_file():
            return folder
    raise FileNotFoundError(f"--run {root}: neither it nor {root / 'final'} holds {PLAIT_CONFIG} (plait train writes "
                            "the trained model to <metrics.run_dir>/final)")


def export_checkpoint(run: str | Path, fmt: str, out: str | Path | None = None) -> Path:
    """Write the trained model of ``run`` (:func:`final_folder`) as ``fmt``'s Hugging Face class and processor to
    ``out`` (default ``<final>/../hf-<fmt>``); returns the folder. Every tensor keeps the dtype it was saved in.
    ``generation_config.json`` lists plait's stop tokens as ``eos_token_id``
    (:func:`plait.models.generation.with_stop_tokens`: the chat template's end of turn too), so transformers'
    ``generate`` stops where ``plait generate`` does.

    Raises:
        ValueError: for an unknown or refused ``fmt`` (naming what plait lacks), a composite the class cannot hold,
            an ``out`` folder holding files.
        FileNotFoundError: for a missing model, ``tokenizer/`` or ``processors/<branch>/`` folder.
    """
    if fmt in REFUSED_EXPORTS:
        raise ValueError(f"--format {fmt}: cannot export: {REFUSED_EXPORTS[fmt]}")
    if fmt not in HF_FORMATS:
        raise ValueError(f"--format {fmt!r}: plait export writes {', '.join(HF_FORMATS)}")
    spec, final = HF_FORMATS[fmt], final_folder(run)
    target = Path(out) if out is not None else final.parent / f"hf-{fmt}"
    if target.exists() and any(target.iterdir()):
        raise ValueError(f"--out {target} already holds files; choose another folder or remove it")
    print(f"plait: reading {final}", flush=True)
    model = MultimodalModel.from_pretrained(final)
    if spec.name in THINKERS:
        return _export_thinker(model, final, target, spec.name)
    if spec.name == "voxtral":
        return _export_voxtral(model, final, target)
    check_exportable(model, spec)
    tokenizer, media = _prepared(model, final)
    hf = hf_from_composite(model, spec, _token_ids(spec.name, tokenizer))
    hf.generation_config = with_stop_tokens(hf.generation_config, tokenizer)  # stop where plait generate stops
    media = next(iter(media.values()))
    print(f"plait: writing {target} ({spec.model_class})", flush=True)
    hf.save_pretrained(target)
    save_hf_processor(spec, model, tokenizer, media, target)
    share_saved_files(target)  # safetensors writes 0600
    return target


def _prepared(model: MultimodalModel, final: Path) -> tuple[Any, dict[str, Any]]:
    """``model`` (read from ``final``) made ready to convert, the same for every format: LoRA adapters merged into the
    LLM and each tower, each projector back in its saved dtype (loading builds it in fp32). Returns the tokenizer
    and, per branch, its image processor or feature extractor, as plait train saved them in ``final/``.

    Raises:
        FileNotFoundError: for a missing ``tokenizer/`` or ``processors/<branch>/`` folder.
    """
    folders = {"tokenizer": final / "tokenizer"}
    folders |= {("processor" if len(model.encoders) == 1 else f"{n} processor"): final / "processors" / n
                for n in model.encoders}
    for what, folder in folders.items():
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} does not exist: the export needs the {what} plait train saves in "
                                    "final/")
    merge_adapters(model.language_model)
    for name, branch in model.encoders.items():
        merge_adapters(branch.encoder)
        saved = load_file(str(final / "encoders" / name / "projector.safetensors"))
        branch.projector.to(next(iter(saved.values())).dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folders["tokenizer"]))
    processors = {n: (transformers.AutoImageProcessor if b.modality == "image" else
                      transformers.AutoFeatureExtractor).from_pretrained(str(final / "processors" / n))
                  for n, b in model.encoders.items()}
    return tokenizer, processors


def _token_ids(fmt: str, tokenizer: transformers.PreTrainedTokenizerBase) -> dict[str, int]:
    """Qwen2.5-VL's config ids of its video and vision start/end tokens that the tokenizer has
    (:data:`plait.models.hf_io.QWEN_VL_TOKENS`), Gemma 3's of its image start/end tokens
    (:data:`plait.models.gemma3.GEMMA3_TOKENS`); ``{}`` for the other formats."""
    tokens = {"qwen2_5_vl": QWEN_VL_TOKENS, "qwen3_vl": QWEN_VL_TOKENS, "gemma3": GEMMA3_TOKENS,
              "qwen3_vl_moe": QWEN_VL_TOKENS, **{name: t.tokens for name, t in THINKERS.items()}}.get(fmt)
    if tokens is None:
        return {}
    ids = {field: tokenizer.convert_tokens_to_ids(token) for field, token in tokens.items()}
    return {field: int(i) for field, i in ids.items() if i is not None and i != tokenizer.unk_token_id}


def _export_thinker(model: MultimodalModel, final: Path, target: Path, fmt: str) -> Path:
    """:func:`export_checkpoint` of an Omni thinker (``fmt``: two branches, :mod:`plait.models.hf_io_omni`): adapters
    merged, each projector in its saved dtype and folded into its tower, the thinker's processor files written.

    Raises:
        ValueError: as :func:`plait.models.hf_io_omni.check_thinker_exportable`.
        FileNotFoundError: for a missing ``tokenizer/`` or ``processors/<branch>/`` folder.
    """
    check_thinker_exportable(model, fmt)
    tokenizer, processors = _prepared(model, final)
    hf = thinker_from_composite(model, _token_ids(fmt, tokenizer), fmt)
    hf.generation_config = with_stop_tokens(hf.generation_config, tokenizer)  # stop where plait generate stops
    media = {model.encoders[n].modality: processor for n, processor in processors.items()}
    print(f"plait: writing {target} ({THINKERS[fmt].model_class})", flush=True)
    hf.save_pretrained(target)
    save_thinker_processor(model, tokenizer, media["image"], media["audio"], target, fmt)
    share_saved_files(target)  # safetensors writes 0600
    return target


def _export_voxtral(model: MultimodalModel, final: Path, target: Path) -> Path:
    """:func:`export_checkpoint` of Voxtral (:mod:`plait.models.hf_io_voxtral`): adapters merged, the projector in its
    saved dtype folded into the tower's projector, the processor files written.

    Raises:
        ValueError: as :func:`plait.models.hf_io_voxtral.check_voxtral_exportable`.
        FileNotFoundError: for a missing ``tokenizer/`` or ``processors/<branch>/`` folder.
    """
    check_voxtral_exportable(model)
    tokenizer, processors = _prepared(model, final)
    hf = voxtral_from_composite(model)
    hf.generation_config = with_stop_tokens(hf.generation_config, tokenizer)  # stop where plait generate stops
    media = next(iter(processors.values()))
    print(f"plait: writing {target} ({VOXTRAL_CLASS})", flush=True)
    hf.save_pretrained(target)
    save_voxtral_processor(model, tokenizer, media, target)
    share_saved_files(target)  # safetensors writes 0600
    return target
