"""Building what a trainer runs, in small steps the command calls before the trainer exists: join the job, load
the tokenizer, compose the model (on the meta device when a pipeline trainer materialises only its own units),
its processor and the datasets (:func:`build_trainer_parts`)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.config.schema import JobConfig
from plait.data.chat_template import tokenizer_dir
from plait.data.loader import MultimodalDataset
from plait.data.metadata import default_cache_dir
from plait.data.mixture import mixture_sources
from plait.models.gemma3 import attends_items
from plait.models.multimodal import MultimodalModel
from plait.models.registry import build_model, build_processor, load_tokenizer
from plait.parallel.process_group import DistInfo, init_distributed
from plait.parallel.tensor_parallel import check_tp_heads
from plait.train.checkpoint import latest_checkpoint, load_model_state
from plait.train.job_file import same_on_every_rank

__all__ = ["TrainerParts", "build_datasets", "build_trainer_parts", "check_tp_degree", "join_job", "metadata_cache_dir",
           "model_from_checkpoint", "seed_everything"]


@dataclass
class TrainerParts:
    """What a trainer is built from.

    Attributes:
        info: this process's rank, world size and device.
        tokenizer: the job's tokenizer (``data.tokenizer``).
        model: the composite model (on ``info.device``, or on the meta device for a pipeline trainer).
        processor: turns records into model inputs (``build_processor``).
        train_set: the training set; val_set: the validation set (None without ``data.val``).
    """

    info: DistInfo
    tokenizer: Any
    model: MultimodalModel
    processor: Any
    train_set: MultimodalDataset
    val_set: MultimodalDataset | None


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's default generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def join_job(cfg: JobConfig, info: DistInfo | None = None) -> DistInfo:
    """This process's place in the job (``info``, or joined from the torchrun environment), with
    ``train.threads`` intra-op threads when set."""
    info = info or init_distributed(cfg.train.device, cfg.parallel.backend, cfg.parallel.timeout_s)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    return info


def build_datasets(cfg: JobConfig, processor: Any, progress: bool) -> tuple[MultimodalDataset,
                                                                            MultimodalDataset | None]:
    """The training set and the validation set (prompts only; None without ``data.val``): each a metadata pass
    (``data.num_workers`` worker processes per rank, cached under :func:`metadata_cache_dir`), samples read
    when their step comes."""
    d = cfg.data
    common = {"on_error": d.on_error, "progress": progress, "workers": d.num_workers,
              "cache_dir": metadata_cache_dir(cfg)}
    train_data, val_data = mixture_sources(d) if d.sources else (d.train, d.val)  # [[data.sources]]: a mixture
    train = MultimodalDataset(train_data, processor, **common)
    val = None
    if val_data:
        val = MultimodalDataset(val_data, processor, prompt_only=True, max_samples=d.val_max_samples, **common)
    return train, val


def metadata_cache_dir(cfg: JobConfig) -> Path | None:
    """The metadata cache folder of ``data.metadata_cache`` (None for ``"off"``)."""
    value = cfg.data.metadata_cache
    if value == "off":
        return None
    return Path(value) if value else default_cache_dir()


def check_tp_degree(cfg: JobConfig, encoders_only: bool = False) -> None:
    """Refuse ``parallel.tp`` (and each ``parallel.pp.encoder_tp`` degree above 1: that branch's plan) when the job's
    model cannot be split that way (:func:`check_tp_heads` on the model composed on the meta device: no weights
    loaded), so a layout error never suggests a launch that would fail on every rank. Does nothing for
    ``parallel.tp`` = 1 without encoder TP. ``encoders_only``: check the ``encoder_tp`` degrees only.

    Raises:
        ValueError: naming the module whose heads the degree does not divide (or the family without a TP plan), the
            field, and saying no launch helps.
    """
    tp = 1 if encoders_only else cfg.parallel.tp
    split = {b: t for b, t in cfg.parallel.pp.encoder_tp.items() if t > 1} if cfg.parallel.pp.degree > 1 else {}
    if tp == 1 and not split:
        return
    model = build_model(cfg.model, load_tokenizer(tokenizer_dir(cfg.data, cfg.model), cfg.data.chat_template),
                        device="meta")
    for branch, degree, field in ([(None, tp, "parallel.tp")] if tp > 1 else []) + [
            (b, t, f"parallel.pp.encoder_tp.{b}") for b, t in split.items()]:
        try:
            check_tp_heads(model, degree, branch)
        except ValueError as exc:
            error = ValueError(f"{exc}: {field}={degree} cannot work for this model with any number of processes; "
                               "pick a degree that divides its heads (of a family with a TP plan)")
            error.same_on_every_rank = True  # type: ignore[attr-defined]  # every rank builds the same model: one line
            raise error from None


def check_item_attention(model: Any, mask: str) -> None:
    """Refuse a job that would train an LLM whose media tokens attend each other both ways (Gemma 3:
    ``models.gemma3.attends_items``) with a causal mask: it would compute something else than the model it came from.

    Raises:
        ValueError: naming ``attention.mask`` and the value to set.
    """
    if mask == "causal" and model.encoders and attends_items(model.language_model.config):
        kind = getattr(model.language_model.config, "model_type", "this LLM")
        raise ValueError(f"attention.mask = 'causal' with a {kind} LLM: its image tokens attend each other both ways "
                         "(as transformers runs it with token_type_ids); set attention.mask = 'bidirectional_items' "
                         "(plait import writes it), or the model trains on another attention than its own")


def build_trainer_parts(cfg: JobConfig, info: DistInfo, meta: bool = False) -> TrainerParts:
    """Seed (``train.seed``), then load the tokenizer (``data.tokenizer`` or the LLM's folder, with
    ``data.chat_template``), compose the model (on the meta device when ``meta``),
    its processor and the datasets (progress bars on the main rank with ``metrics.progress``).

    Raises:
        ValueError, FileNotFoundError: a missing or bad file, config value or record (the metadata pass's errors are
            raised after its results are gathered), marked ``same_on_every_rank``: every rank reads the same files
            and config, so under torchrun the command line prints the error once (``plait.cli``).
    """
    seed_everything(cfg.train.seed)
    with same_on_every_rank():
        tokenizer = load_tokenizer(tokenizer_dir(cfg.data, cfg.model), cfg.data.chat_template)
        model = build_model(cfg.model, tokenizer, device="meta" if meta else info.device, seed=cfg.train.seed)
        check_item_attention(model, cfg.attention.mask)
        processor = build_processor(cfg.model, model, tokenizer, cfg.data.max_length)
        train, val = build_datasets(cfg, processor, cfg.metrics.progress and info.is_main)
    return TrainerParts(info, tokenizer, model, processor, train, val)


def model_from_checkpoint(cfg: JobConfig, tokenizer: Any, run_dir: Path, path: str | Path | None,
                          device: torch.device) -> MultimodalModel:
    """The whole model with the weights of checkpoint ``path`` (default: the newest under ``run_dir``), on
    ``device``, built in this process alone (no collective): for export by trainers that hold a part of the model
    (pipeline stages, FSDP2 shards). Built from the config like the trained model (same seed: the parts in no
    pipeline unit, such as a pooling head, are never trained or saved and keep their initial values), then loaded
    with DCP.

    Raises:
        FileNotFoundError: when there is no checkpoint.
    """
    path = Path(path) if path else latest_checkpoint(run_dir)
    if path is None:
        raise FileNotFoundError(f"no checkpoint under {Path(run_dir) / 'checkpoints'} to build the model from")
    model = build_model(cfg.model, tokenizer, seed=cfg.train.seed)
    load_model_state(path, model)
    return model.to(device)
