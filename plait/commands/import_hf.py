"""``plait import``: a local Hugging Face multimodal checkpoint as a plait model and a job that trains from it.

``plait import --from llava-1.5-7b-hf --out imported/llava15`` reads a ``LlavaForConditionalGeneration``
(LLaVA-1.5 style), ``Qwen2AudioForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``, ... or a
Qwen2.5-Omni thinker (``Qwen2_5OmniThinkerForConditionalGeneration``, or a full Omni checkpoint's thinker) folder
(weights, ``config.json``, processor and tokenizer files, as ``save_pretrained`` writes them) and writes

- ``<out>/model/``: the composite as ``plait train`` writes ``final/`` (LLM, encoder and projector weights,
  ``plait_config.json`` with the feature layer, selection and placeholder id; ``tokenizer/`` with the chat
  template; ``processors/<branch>/`` with the image processor or feature extractor), loadable by
  ``model.pretrained``, ``plait generate --model`` and ``plait export``;
- ``<out>/job.toml``: a job that fine-tunes it (``model.pretrained`` = that folder; set ``data.train``).

The mapping is :mod:`plait.models.hf_io` (the same tensors, so ``plait export`` gives the checkpoint back
bit-identically). A Qwen2.5-VL folder's processor is read as its parts (``AutoImageProcessor``: the PIL
``Qwen2VLImageProcessorPil`` with its min/max pixels, patch, merge and temporal sizes; the tokenizer and chat
template), since ``Qwen2_5_VLProcessor`` needs torchvision for its video processor; its placeholder is
``<|image_pad|>`` (records write ``<|vision_start|><|image_pad|><|vision_end|>`` per image, as its chat template
does).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import transformers
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoFeatureExtractor, AutoImageProcessor, AutoProcessor, AutoTokenizer

from plait.config.schema import VideoConfig
from plait.data.chat_template import read_chat_template
from plait.data.sources import path_note
from plait.models.hf_io import (QWEN_VL_FORMATS, HfFormat, composite_from_hf, hf_format_of,
                                string_content_template)
from plait.models.hf_io_omni import THINKERS, composite_from_thinker, load_thinker
from plait.models.hf_io_voxtral import composite_from_voxtral
from plait.models.multimodal import MultimodalModel

__all__ = ["import_command", "import_checkpoint", "job_toml", "check_weights", "imported_video", "WEIGHT_FILES",
           "VIDEO_FPS", "VIDEO_FORMATS"]

VIDEO_FPS = 2.0
"""Frames sampled per second of an imported video-capable model (its video processor's default ``fps``)."""
VIDEO_FORMATS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", *THINKERS)
"""The ``--format`` names whose image branch takes videos (transformers' video token and video processor)."""


def imported_video(fmt: HfFormat) -> dict[str, Any] | None:
    """The video settings of an imported model's image branch, as ``[model.encoders.<branch>.video]`` would set
    them: ``{"placeholder", "fps", "max_frames", "audio"}`` with transformers' video token (``<|video_pad|>``, the
    Qwen2.5-Omni thinker's ``<|VIDEO|>``), :data:`VIDEO_FPS` frames per second, the default frame limit and no
    audio track; None for a format whose model takes no video. :func:`import_checkpoint` saves them in the model's
    ``plait_config.json`` (so ``plait generate --video`` reads videos on a fresh import) and the job writes them."""
    if fmt.name not in VIDEO_FORMATS:
        return None
    placeholder = THINKERS[fmt.name].placeholders[2] if fmt.name in THINKERS else "<|video_pad|>"
    default = VideoConfig()
    return {"placeholder": placeholder, "fps": VIDEO_FPS, "max_frames": default.max_frames, "audio": False}


def import_command(source: str | Path, out: str | Path, *, train: str = "", val: str = "",
                   chat_template: str = "") -> int:
    """``plait import``: :func:`import_checkpoint`, then print what was written and the train command (first asking
    to set ``data.train`` when ``train`` was not given). Returns 0.

    Raises:
        ValueError, FileNotFoundError: as :func:`import_checkpoint`; FileNotFoundError for a ``--train`` or ``--val``
            file that does not exist (checked first: the job would name it).
    """
    for flag, path in (("--train", train), ("--val", val)):  # H4: the job must not name a missing data file
        if path and not Path(path).is_file():
            raise FileNotFoundError(f"plait import {flag} {path}: no such data file{path_note(path)}")
    model_dir, job = import_checkpoint(source, out, train=train, val=val, chat_template=chat_template)
    print(f"plait: imported {source} into {model_dir} (model.pretrained) and the job {job}", flush=True)
    if train:  # the job names the data already
        print(f"plait: train with: plait train --config {job}", flush=True)
    else:
        print(f"plait: set data.train in {job}, then: plait train --config {job}", flush=True)
    return 0


def import_checkpoint(source: str | Path, out: str | Path, *, train: str = "", val: str = "",
                      chat_template: str = "") -> tuple[Path, Path]:
    """Write ``<out>/model`` and ``<out>/job.toml`` from the checkpoint folder ``source`` (module docstring).

    Args:
        train, val: data files the job names (default: ``<out>/train.jsonl``, no validation).
        chat_template: a Jinja file or committed template name for a checkpoint without a chat template.

    Returns:
        ``(model folder, job file)``.

    Raises:
        FileNotFoundError: when ``source`` is not a folder.
        ValueError: for a folder without ``config.json``, weights (:func:`check_weights`) or processor files, an
            unreadable ``config.json`` or weight file (each named, in one line), an unsupported or refused class
            (:func:`plait.models.hf_io.hf_format_of`), a placeholder token that is not the config's id, no chat
            template, or an ``out`` folder that already holds a model.
    """
    src, root = Path(source), Path(out)
    fmt, config = _format(src)
    weights = check_weights(src)  # a damaged checkpoint named before anything is read or written
    model_dir = root / "model"
    if model_dir.exists() and any(model_dir.iterdir()):
        raise ValueError(f"{model_dir} already holds files; choose another --out or remove it")
    processor = _processor(src, fmt)
    omni = fmt.name in THINKERS  # a thinker: two branches (plait.models.hf_io_omni)
    media = processor.image_processor if fmt.modality == "image" else processor.feature_extractor
    tokenizer = processor.tokenizer
    tokenizer.chat_template = _chat_template(processor, tokenizer, chat_template, src)  # checked before the weights
    _check_placeholder(fmt, config, processor, src)
    print(f"plait: reading {src} ({fmt.model_class})", flush=True)
    hf = _load_model(src, fmt, weights)
    sound = processor.feature_extractor if omni or fmt.modality == "audio" else None
    audio = {"hop_length": int(sound.hop_length), "sampling_rate": int(sound.sampling_rate)} if sound else {}
    if fmt.name == "voxtral":  # the tower holds the projector (plait.models.hf_io_voxtral)
        model = composite_from_voxtral(hf, **audio)
    else:
        model = composite_from_thinker(hf, **audio) if omni else composite_from_hf(hf, fmt, **audio)
    print(f"plait: writing {model_dir}", flush=True)
    video = imported_video(fmt)  # what plait generate --video needs, as plait train saves the job's video table
    model.save_pretrained(model_dir, video={fmt.branch: video} if video else None)
    tokenizer.save_pretrained(model_dir / "tokenizer")
    media.save_pretrained(model_dir / "processors" / fmt.branch)
    if omni:
        sound.save_pretrained(model_dir / "processors" / "audio")
    job = root / "job.toml"
    job.write_text(job_toml(fmt, src, model_dir, model, train or str(root / "train.jsonl"), val))
    return model_dir, job


def _format(src: Path) -> tuple[HfFormat, Any]:
    """The checkpoint's :class:`HfFormat` and config (its ``config.json``)."""
    if not src.is_dir():
        raise FileNotFoundError(f"--from {src}: no such folder{path_note(src)}")
    if not (src / "config.json").is_file():
        raise ValueError(f"--from {src}: no config.json (a Hugging Face checkpoint folder, as save_pretrained "
                         "writes it)")
    try:
        config = AutoConfig.from_pretrained(str(src))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--from {src}: cannot read {src / 'config.json'}: {_first_line(exc)}") from None
    return hf_format_of(config, str(src)), config


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""The weight files ``from_pretrained`` looks for in a checkpoint folder, in its order (one file, or an index of
shards)."""


def check_weights(src: Path) -> list[Path]:
    """The weight files of the checkpoint folder ``src`` (the first of :data:`WEIGHT_FILES` present; an index's
    shards), each safetensors file's header read and checked against the file's size (``safetensors.safe_open``):
    a damaged checkpoint is named here, in one line, before any weight is loaded.

    Raises:
        ValueError: naming the folder when it holds no weight file, or the file that is missing (a shard an index
            names), unreadable, or truncated.
    """
    name = next((n for n in WEIGHT_FILES if (src / n).is_file()), None)
    if name is None:
        raise ValueError(f"--from {src}: no weights (none of {', '.join(WEIGHT_FILES)}; a Hugging Face checkpoint "
                         "folder, as save_pretrained writes it)")
    files = [src / name]
    if name.endswith(".index.json"):
        try:
            shards = sorted(set(json.loads(files[0].read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"--from {src}: cannot read the weight index {files[0]}: {_first_line(exc)}") from None
        files = [src / shard for shard in shards]
    for file in files:
        if not file.is_file():
            raise ValueError(f"--from {src}: the weight file {file} is missing (named by {src / name})")
        if file.suffix == ".safetensors":
            try:
                with safe_open(str(file), framework="pt"):
                    pass
            except (OSError, SafetensorError) as exc:
                raise ValueError(f"--from {src}: {file} is not a readable safetensors file (truncated or damaged: "
                                 f"{_first_line(exc)})") from None
    return files


def _load_model(src: Path, fmt: HfFormat, files: list[Path]) -> Any:
    """The checkpoint as its transformers class, in eval mode (``files``: its weight files, as
    :func:`check_weights` found them).

    Raises:
        ValueError: naming the folder and transformers' reason when loading still fails (a damaged ``.bin``, weights
            that do not fit the config).
    """
    try:
        if fmt.name in THINKERS:  # a thinker, or a full Omni checkpoint's thinker
            return load_thinker(src)
        return getattr(transformers, fmt.model_class).from_pretrained(str(src)).eval()
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError, EOFError, pickle.UnpicklingError) as exc:
        names = ", ".join(str(f) for f in files)
        raise ValueError(f"--from {src}: cannot load the weights ({names}) as {fmt.model_class}: "
                         f"{_first_line(exc)}") from None


def _first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, at most ``limit`` characters (a library's error text in one line)."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text if len(text) <= limit else text[:limit] + "..."


def _processor(src: Path, fmt: HfFormat) -> Any:
    """The checkpoint's Hugging Face processor (image processor or feature extractor, tokenizer, chat template);
    for Qwen2.5-VL its parts (``image_processor``, ``tokenizer``, ``chat_template``, ``image_token``).

    Raises:
        ValueError: when the folder holds no processor files.
    """
    try:
        if fmt.name in THINKERS:  # its processor needs torchvision (video processor): its parts
            tokenizer = AutoTokenizer.from_pretrained(str(src))
            image, audio, _ = THINKERS[fmt.name].placeholders
            return SimpleNamespace(image_processor=AutoImageProcessor.from_pretrained(str(src)), tokenizer=tokenizer,
                                   feature_extractor=AutoFeatureExtractor.from_pretrained(str(src)),
                                   chat_template=tokenizer.chat_template, image_token=image, audio_token=audio)
        if fmt.name == "voxtral":  # VoxtralProcessor tokenizes chats with mistral-common: its parts
            tokenizer = AutoTokenizer.from_pretrained(str(src))
            return SimpleNamespace(feature_extractor=AutoFeatureExtractor.from_pretrained(str(src)),
                                   tokenizer=tokenizer, chat_template=tokenizer.chat_template, audio_token="[AUDIO]")
        if fmt.name in QWEN_VL_FORMATS:  # their processors need torchvision (video processor)
            tokenizer = AutoTokenizer.from_pretrained(str(src))
            return SimpleNamespace(image_processor=AutoImageProcessor.from_pretrained(str(src)), tokenizer=tokenizer,
                                   chat_template=tokenizer.chat_template,
                                   image_token=getattr(tokenizer, "image_token", None) or "<|image_pad|>")
        return AutoProcessor.from_pretrained(str(src))
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"--from {src}: cannot load its processor ({str(exc)[:200]}); the folder needs the "
                         "processor and tokenizer files (processor_config.json or preprocessor_config.json, "
                         "tokenizer files)") from None


def _check_placeholder(fmt: HfFormat, config: Any, processor: Any, src: Path) -> None:
    """The processor's placeholder token must be the model's placeholder id.

    Raises:
        ValueError: naming both.
    """
    token = processor.image_token if fmt.modality == "image" else processor.audio_token
    if fmt.name == "gemma3":  # Gemma3Processor's image_token is <start_of_image>; the soft tokens are the placeholder
        token = processor.tokenizer.image_token
    checks = [(token, fmt.token_field)]
    if fmt.name in THINKERS:  # the thinker's ids (a full Omni checkpoint: its thinker_config's)
        config = getattr(config, "thinker_config", config)
        checks.append((processor.audio_token, "audio_token_id"))
    for token, field in checks:
        tid = processor.tokenizer.convert_tokens_to_ids(token)
        want = int(getattr(config, field))
        if tid != want:
            raise ValueError(f"--from {src}: the processor's placeholder {token!r} is token {tid}, but the model's "
                             f"{field} is {want}")


def _chat_template(processor: Any, tokenizer: Any, override: str, src: Path) -> str:
    """The chat template plait renders records with: ``override`` (a file or committed name), else the processor's
    or tokenizer's, made to render string contents (:func:`plait.models.hf_io.string_content_template`).

    Raises:
        ValueError: when there is none.
    """
    if override:
        return read_chat_template(override)
    template = getattr(processor, "chat_template", None) or tokenizer.chat_template
    if not template:
        raise ValueError(f"--from {src}: no chat template in the processor or tokenizer; give --chat-template "
                         "(a Jinja file or a committed name such as chatml)")

    def render(text: str, messages: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(messages, chat_template=text, tokenize=False)

    return string_content_template(template, render)


def _video_table(fmt: HfFormat) -> str:
    """The job's ``[model.encoders.<branch>.video]`` table of a video-capable import (:func:`imported_video`, the
    settings the model folder saves too; the thinkers' ``[model.encoders.audio]`` after it), else ``""``."""
    settings = imported_video(fmt)
    if settings is None:
        return ""
    pad, fps = settings["placeholder"], settings["fps"]
    head = f'\n[model.encoders.{fmt.branch}.video]\nplaceholder = "{pad}"  # '
    tail = f"\nfps = {fps}  # sampled frames per second (its video processor's default)\n"
    if fmt.name == "qwen2_5_vl":
        return head + "transformers' video token: a video is positioned as Qwen2_5_VLProcessor gives it" + tail
    if fmt.name not in THINKERS:  # Qwen3-VL(-MoE)
        return (head + "records write <|vision_start|><|video_pad|><|vision_end|>; each temporal patch gets its "
                "<t seconds> and <|vision_start|> ... <|vision_end|>, as Qwen3VLProcessor writes it" + tail)
    vs, ve, aus, aue = THINKERS[fmt.name].starts
    return (head + f"records write {vs}{pad}{ve}; with audio = true {vs}{aus}{pad}{aue}{ve}" + tail
            + "audio = false  # true: each video's audio track goes in with it, time-aligned (use_audio_in_video)\n"
            "\n[model.encoders.audio]\nfreeze = true  # the audio tower as imported\nfreeze_projector = true  # the "
            "identity after its projection (export folds it in)\n")


def job_toml(fmt: HfFormat, src: Path, model_dir: Path, model: MultimodalModel, train: str, val: str) -> str:
    """The text of the imported job: fine-tune the LLM and projector, the tower frozen (LLaVA-1.5's stage 2;
    Qwen2.5-VL: the LLM, the tower with its merger frozen and plait's identity projector after it frozen too, and
    videos at ``<|video_pad|>``, 2 frames per second, as ``Qwen2_5_VLProcessor`` takes them), sequences up to the
    LLM's ``max_position_embeddings`` (at most 2048 tokens)."""
    limit = int(getattr(model.language_model.config, "max_position_embeddings", 2048) or 2048)
    token = model.placeholder_ids[fmt.branch]
    val_line = f'val = "{Path(val).resolve()}"\n' if val else ""
    projector_line = ("freeze_projector = true  # the identity after the tower's merger, its projector (false: train "
                      "it too; export folds it into the merger)\n" if not fmt.projector_keys else "")
    run_dir = (model_dir.parent / "runs" / "finetune").resolve()
    attention = ('\n[attention]\nmask = "bidirectional_items"  # Gemma 3: the tokens of one image see each other both '
                 "ways\n" if fmt.name == "gemma3" else "")
    video = _video_table(fmt)
    return f"""# plait job written by plait import from {src.resolve()} ({fmt.model_class}).
# The model (LLM, {fmt.branch} encoder and projector, placeholder id {token}, processor, chat template) is in
# {model_dir.resolve()}. Set data.train (plait JSONL, LLaVA JSON or Parquet; one placeholder per item in the text,
# as the tokenizer's processor writes it), then
#   plait train --config <this file>
# and back to Hugging Face: plait export --run {run_dir} --format {fmt.name}

[model]
pretrained = "{model_dir.resolve()}"

[model.llm]
freeze = false

[model.encoders.{fmt.branch}]
freeze = true  # the tower as imported (false: train it too)
{projector_line}{video}{attention}
[data]
train = "{Path(train).resolve()}"
{val_line}max_length = {min(limit, 2048)}

[train]
global_batch_size = 16
microbatch_size = 4
epochs = 1
lr = 2e-5
warmup_steps = 10
weight_decay = 0.0
grad_clip = 1.0

[metrics]
run_dir = "{run_dir}"
"""
