"""Per-call inputs of an encoder tower's layers: the one hook through which every layer unit of a tower receives
what its family computes once per encoder call (rotary tables, packed-sequence boundaries, window indices, block
masks) from the call's metadata (``grid_thw``, image sizes).

The stock Hugging Face forward computes these itself, so the single-process path and a pipeline stage that owns
the tower's embedding run it unchanged. A stage that starts inside the layers calls them one by one: it builds a
:class:`TowerCall` from the same item group's stock-forward kwargs (``ModalityEncoder.item_groups``; every stage
has the microbatch's ``modality_inputs``, so nothing extra travels between stages: the inputs are recomputed from
the metadata) and runs each layer through :meth:`TowerCall.layer`. Activation checkpointing wraps a layer's
``forward`` and passes keyword arguments through, so recomputation sees the same per-call tensors (they carry no
gradient).

A family with per-call inputs writes a class with :class:`TowerCall`'s constructor and four methods in its
``models/families/`` module (duck-typed: the family modules import nothing of ``plait.models`` but
``families/``, which keeps ``models.hf`` free of cycles) and names it as its family's ``tower_call``
(:data:`TOWER_CALLS` collects them by ``model_type``); the constructor must compute from the kwargs' metadata and
the config only (on a later stage the embedding is an ``nn.Identity`` and modules in no unit may be on the meta
device).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from plait.models.families import FAMILIES
from plait.models.hf import run_encoder_layer

__all__ = ["TowerCall", "TOWER_CALLS", "tower_call"]


class TowerCall:
    """One encoder call's per-call layer inputs (default: none, the ViT / Whisper families).

    Args:
        encoder: the Hugging Face tower (possibly a pipeline rank's pruned one).
        kwargs: the stock-forward kwargs of one item group (``ModalityEncoder.item_groups``).
    """

    def __init__(self, encoder: PreTrainedModel, kwargs: dict[str, Any]) -> None:
        self.encoder = encoder

    def stock_output(self, out: Any, owns_post_norm: bool) -> torch.Tensor:
        """The hidden states a stage owning the embedding takes from the stock forward's output ``out`` (the
        post-norm swapped for ``nn.Identity`` unless ``owns_post_norm``); default ``out.last_hidden_state``."""
        return out.last_hidden_state

    def layer(self, layer: nn.Module, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Layer number ``index`` (its index in the tower's full layer list) applied to ``hidden``; default
        :func:`plait.models.hf.run_encoder_layer` (no mask)."""
        return run_encoder_layer(layer, hidden)

    def post_norm(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The tower's post-layer unit applied to ``hidden`` on a stage that does not own the embedding."""
        return module(hidden)


TOWER_CALLS: dict[str, Any] = {t: f.tower_call for f in FAMILIES if f.tower_call is not None for t in f.model_types}
"""``model_type`` -> the family's per-call class (the :class:`TowerCall` interface); other families use
:class:`TowerCall`."""


def tower_call(encoder: PreTrainedModel, kwargs: dict[str, Any]) -> TowerCall:
    """The per-call inputs of ``encoder``'s family for one item group's stock-forward ``kwargs``."""
    return TOWER_CALLS.get(encoder.config.model_type, TowerCall)(encoder, kwargs)
