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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

__all__ = ["DeepStackFeatures", "DEEPSTACK_KWARG", "deepstack_extras", "attach_deepstack_hooks"]

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
    """

    dense: tuple[torch.Tensor, ...]
    prompt_only: bool = False

    def select(self, pick: Callable[[torch.Tensor], torch.Tensor]) -> "DeepStackFeatures":
        """The same additions with ``pick`` applied to each dense tensor (a shard's tokens, a prompt's prefix)."""
        return DeepStackFeatures(tuple(pick(t) for t in self.dense), self.prompt_only)


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
            if extras is None or j >= len(extras.dense):
                return None
            hidden = output[0] if isinstance(output, tuple) else output
            extra = extras.dense[j]
            if extra.shape != hidden.shape:
                if extras.prompt_only:
                    return None
                raise ValueError(f"DeepStack addition {tuple(extra.shape)} for LLM layer {j}, whose output is "
                                 f"{tuple(hidden.shape)}")
            summed = hidden + extra.to(hidden.dtype)
            return (summed, *output[1:]) if isinstance(output, tuple) else summed
        return add

    return [layers[j].register_forward_hook(hook(j), with_kwargs=True) for j in range(count)]
