"""DeepStack (Meng et al., arXiv 2406.04334; Qwen3-VL): extra encoder features ADDED to the LLM's hidden states at the
visual token positions after its first decoder layers.

A branch whose tower gives DeepStack features (``plait.models.families.qwen3_vl``) hands the composite one feature
row per placeholder of ``(1 + k) * hidden`` values: the feature placed into the embedding, then the feature for
LLM layer ``j`` (``j = 0 .. k-1``). :func:`deepstack_extras` turns the rows into dense ``[B, N, hidden]`` tensors
(zero off the visual tokens; adding a zero leaves a hidden state bit for bit as it was, so the dense add equals
transformers' masked add), and a forward hook on decoder layer ``j`` (:func:`attach_deepstack_hooks`) adds tensor
``j`` to the layer's output. The tensors reach the hook as the ``plait_deepstack`` keyword argument of the LLM's
forward, which transformers' decoder stacks pass on to every layer (as ``plait_mask`` and ``plait_cp``), so
activation checkpointing's recomputation sees them too and nothing is kept on the model between calls.

Across LLM pipeline stages the additions travel with the hidden states (:func:`carried_rows`,
:func:`received_features`): a stage sends, besides its output hidden states, the rows of the visual tokens (its
tokens: a context-parallel shard's) for the receiving layers held by later stages, ``[visual tokens,
later receivers * hidden]``, and the next stage rebuilds its dense additions from them and the token ids. The rows are
a function of the encoder features, so their gradients flow back along the same hop to the features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

__all__ = ["DeepStackFeatures", "DEEPSTACK_KWARG", "deepstack_extras", "attach_deepstack_hooks", "deepstack_mask",
           "carried_rows", "received_features"]

DEEPSTACK_KWARG = "plait_deepstack"
"""The LLM forward's keyword argument carrying a :class:`DeepStackFeatures`."""


@dataclass(frozen=True)
class DeepStackFeatures:
    """The DeepStack additions of one forward.

    Attributes:
        dense: per receiving layer ``j`` (LLM layer index ``j``), ``[B, n, hidden]``: the feature of each visual
            token at its position, zero elsewhere (``n``: the tokens the LLM runs on, a context-parallel shard's).
        prompt_only: a cached generation: a layer call on another number of tokens than ``n`` (a decoding step)
            gets nothing; otherwise such a call is an error.
        first: the LLM layer of ``dense[0]`` (a later pipeline stage's additions start at its first receiving
            layer): ``dense[i]`` is added after layer ``first + i``.
    """

    dense: tuple[torch.Tensor, ...]
    prompt_only: bool = False
    first: int = 0

    def select(self, pick: Callable[[torch.Tensor], torch.Tensor]) -> "DeepStackFeatures":
        """The same additions with ``pick`` applied to each dense tensor (a shard's tokens, a prompt's prefix)."""
        return DeepStackFeatures(tuple(pick(t) for t in self.dense), self.prompt_only, self.first)

    @property
    def end(self) -> int:
        """One past the last LLM layer with an addition."""
        return self.first + len(self.dense)


def deepstack_extras(input_ids: torch.Tensor, features: Mapping[str, torch.Tensor], placeholder_ids: Mapping[str, int],
                     hidden: int) -> DeepStackFeatures | None:
    """Dense DeepStack additions of a batch: for each branch whose rows are wider than ``hidden``, chunk ``j + 1``
    of its rows scattered (row-major) into its placeholder positions; summed over branches. None when no branch has
    extra chunks.

    Args:
        input_ids: ``[B, N]``; features: per branch ``[placeholders, (1 + k) * hidden]``; hidden: the LLM width.

    Raises:
        ValueError: for rows whose width is not a multiple of ``hidden``.
    """
    dense: list[torch.Tensor] = []
    for name, feats in features.items():
        width = feats.shape[-1]
        if width % hidden:
            raise ValueError(f"encoder {name!r} gives features of width {width}, not a multiple of the LLM's {hidden}")
        if width == hidden:  # a branch without DeepStack features (an audio tower beside Qwen3-VL's)
            continue
        mask = (input_ids == placeholder_ids[name]).unsqueeze(-1)
        for j, chunk in enumerate(feats[:, hidden:].split(hidden, dim=-1)):
            add = torch.zeros(*input_ids.shape, hidden, dtype=chunk.dtype, device=chunk.device)
            add = add.masked_scatter(mask.to(chunk.device), chunk)
            if j < len(dense):
                dense[j] = dense[j] + add
            else:
                dense.append(add)
    return DeepStackFeatures(tuple(dense)) if dense else None


def attach_deepstack_hooks(layers: nn.ModuleList, count: int) -> list[Any]:
    """Forward hooks adding ``plait_deepstack.dense[j]`` to the output of ``layers[j]`` for ``j < count`` (a layer
    without additions in a call, or a call without ``plait_deepstack``, is left alone). Returns the handles.

    Raises:
        ValueError: when the LLM has fewer than ``count`` layers; at a call, when the additions' shape differs from
            the layer output's (outside :attr:`DeepStackFeatures.prompt_only` decoding steps).
    """
    if count > len(layers):
        raise ValueError(f"{count} DeepStack features per visual token but the LLM has {len(layers)} layers")

    def hook(j: int) -> Callable[..., Any]:
        def add(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
            extras = kwargs.get(DEEPSTACK_KWARG)
            if extras is None or not extras.first <= j < extras.end:
                return None
            hidden = output[0] if isinstance(output, tuple) else output
            extra = extras.dense[j - extras.first]
            if extra.shape != hidden.shape:
                if extras.prompt_only:
                    return None
                raise ValueError(f"DeepStack addition {tuple(extra.shape)} for LLM layer {j}, whose output is "
                                 f"{tuple(hidden.shape)}")
            summed = hidden + extra.to(hidden.dtype)
            return (summed, *output[1:]) if isinstance(output, tuple) else summed
        return add

    return [layers[j].register_forward_hook(hook(j), with_kwargs=True) for j in range(count)]


def deepstack_mask(input_ids: torch.Tensor, placeholder_ids: Mapping[str, int]) -> torch.Tensor:
    """``[B, N]`` bool: the tokens that receive DeepStack additions, the placeholders of the branches in
    ``placeholder_ids`` (those whose features carry DeepStack chunks)."""
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for pid in placeholder_ids.values():
        mask |= input_ids == pid
    return mask


def carried_rows(extras: DeepStackFeatures, mask: torch.Tensor, start: int) -> torch.Tensor:
    """What a pipeline stage sends on for the receiving layers ``start .. extras.end - 1`` held by later stages: the
    additions at the ``mask`` tokens, row-major, layer after layer along the feature dim, ``[mask.sum(), (end - start)
    * hidden]`` (a copy of the dense values, so the next stage's rebuilt additions are bit for bit these).

    Args:
        extras: the stage's additions (``dense`` ``[B, n, hidden]`` from layer ``extras.first``); mask: ``[B, n]``
            (:func:`deepstack_mask` of the stage's tokens); start: the first layer of a later stage,
            ``extras.first <= start < extras.end``.

    Raises:
        ValueError: for ``start`` outside ``[extras.first, extras.end)``.
    """
    if not extras.first <= start < extras.end:
        raise ValueError(f"DeepStack rows from LLM layer {start} asked of additions for layers "
                         f"{extras.first}..{extras.end - 1}")
    return torch.cat([extras.dense[j - extras.first][mask] for j in range(start, extras.end)], dim=-1)


def received_features(rows: torch.Tensor, mask: torch.Tensor, hidden: int, first: int) -> DeepStackFeatures:
    """The additions a pipeline stage rebuilds from :func:`carried_rows`: chunk ``i`` of ``rows``
    (``[mask.sum(), k * hidden]``) scattered into the ``mask`` ``[B, n]`` tokens (zero elsewhere), for layer
    ``first + i``.

    Raises:
        ValueError: when the rows do not match the mask's token count or a multiple of ``hidden``.
    """
    count = int(mask.sum())
    if rows.shape[0] != count or rows.shape[-1] % hidden or not rows.shape[-1]:
        raise ValueError(f"DeepStack rows {tuple(rows.shape)} for {count} visual tokens of a {hidden}-wide LLM")
    zeros = torch.zeros(*mask.shape, hidden, dtype=rows.dtype, device=rows.device)
    where = mask.unsqueeze(-1).to(rows.device)
    return DeepStackFeatures(tuple(zeros.masked_scatter(where, c) for c in rows.split(hidden, dim=-1)), first=first)
