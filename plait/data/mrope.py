"""Multimodal rotary positions (M-RoPE) of Qwen2-VL / Qwen2.5-VL LLMs, per sample, computed by transformers.

Qwen2.5-VL's LLM rotates every token with three position streams (temporal, height, width): text tokens carry the
same position on all three, counting on from the last one; the features of an image or video grid ``(t, h, w)``
(in patches; ``t h w / m^2`` features for the tower's ``spatial_merge_size`` ``m``) carry their ``(t, h / m, w /
m)`` coordinates offset by the position where the item starts, and the text after the item continues at that start
plus ``max(h, w) / m``. The one implementation is transformers' own ``Qwen2_5_VLModel.get_rope_index`` (with its
``get_vision_position_ids``), called here on the class with a stand-in holding just the two config values it reads
(``spatial_merge_size``, ``tokens_per_second``), as :mod:`plait.models.families.internvl` calls
``InternVLModel.pixel_shuffle``: no copy of the rule.

An item is positioned as a video (transformers' token type 2: its temporal patches ``tokens_per_second x
second_per_grid_t`` positions apart, ``video_grid_thw`` and ``second_per_grid_ts`` as ``Qwen2_5_VLProcessor`` gives
them) when it carries its timing (a Qwen2.5-VL video, :class:`plait.models.families.qwen2_5_vl.TemporalPatches`),
else as an image (``time_interval`` 1). The placeholder tokens under a video stay the branch's image placeholder:
the LLM never sees them (features replace their embeddings, as transformers replaces ``<|video_pad|>``'s), so only
the positions differ between the two, and they are transformers' video positions. The merge size is read from the
data: an item of grid ``(t, h, w)`` with ``k`` tokens has ``m = sqrt(t h w / k)`` (the collator does not know the
tower).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Sequence

import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

__all__ = ["mrope_positions", "next_mrope_positions"]


def _merge_size(grid: Sequence[int], tokens: int, item: int) -> int:
    """``m`` with ``t h w / m^2 == tokens`` for item number ``item``.

    Raises:
        ValueError: when no integer ``m`` fits.
    """
    t, h, w = (int(g) for g in grid)
    m = math.isqrt(max(1, t * h * w // max(tokens, 1)))
    if tokens < 1 or m < 1 or t * h * w != tokens * m * m or h % m or w % m:
        raise ValueError(f"item {item}: grid {t}x{h}x{w} with {tokens} placeholder tokens is not t*h*w/m^2 tokens "
                         "of m x m merged blocks (M-RoPE positions need the tower's merged grid)")
    return m


def mrope_positions(input_ids: torch.Tensor, item_ids: torch.Tensor, grids: Sequence[Sequence[int] | None],
                    timing: Sequence[tuple[float, float] | None] | None = None) -> torch.Tensor:
    """M-RoPE positions ``[3, n]`` int64 of one document (module docstring), by ``Qwen2_5_VLModel.get_rope_index``.

    Args:
        input_ids: ``[n]`` token ids of the document.
        item_ids: ``[n]``: -1 on text, else the index of the media item (into ``grids``) the token belongs to.
        grids: per item, its grid ``(t, h, w)`` in patches, or None for an item without a grid (another branch,
            such as audio: its tokens are positioned as text, which is what a 1-D LLM position is).
        timing: per item, ``(second_per_grid_t, tokens_per_second)`` for a video (seconds of video per temporal
            patch; the tower's temporal position step per second), None for an image; None: every item an image.

    Raises:
        ValueError: for an item whose token count is not ``t h w / m^2``, grid items of different merge sizes,
            videos of different ``tokens_per_second``, or two grid items with no text token between them
            (transformers would take them for one item).
    """
    ids, items = input_ids.reshape(-1).long(), item_ids.reshape(-1).long()
    gridded = torch.tensor([g is not None for g in grids] + [False], dtype=torch.bool)
    slot = torch.where(items >= 0, items, len(grids))  # each token's item, len(grids) for text
    on_grid = gridded[slot]
    if not bool(on_grid.any()):
        return torch.arange(ids.numel()).expand(3, -1).clone()
    order = [int(i) for i in torch.unique_consecutive(items[on_grid])]
    if len(set(order)) != len(order):
        raise ValueError("an item's tokens are not contiguous in the document")
    merges = {_merge_size(grids[i], int((items == i).sum()), i) for i in order}  # type: ignore[arg-type]
    if len(merges) != 1:
        raise ValueError(f"grid items of merge sizes {sorted(merges)} in one document")
    _check_separated(items, on_grid)
    timing = list(timing) if timing is not None else [None] * len(grids)
    videos = [i for i in order if timing[i] is not None]
    rates = {float(timing[i][1]) for i in videos}  # type: ignore[index]
    if len(rates) > 1:
        raise ValueError(f"videos of tokens_per_second {sorted(rates)} in one document")
    holder = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merges.pop(),
                                                             tokens_per_second=rates.pop() if rates else 1)),
        get_vision_position_ids=lambda *a, **k: Qwen2_5_VLModel.get_vision_position_ids(None, *a, **k))
    kinds = torch.tensor([2 if t is not None else 1 for t in timing] + [0], dtype=torch.int)
    types = torch.where(on_grid, kinds[slot], 0)

    def grid(chosen: list[int]) -> torch.Tensor | None:
        rows = [[int(g) for g in grids[i]] for i in chosen]  # type: ignore[union-attr]
        return torch.tensor(rows, dtype=torch.long) if rows else None

    seconds = torch.tensor([float(timing[i][0]) for i in videos]) if videos else None  # type: ignore[index]
    positions, _ = Qwen2_5_VLModel.get_rope_index(holder, ids[None], types[None], image_grid_thw=grid(
        [i for i in order if timing[i] is None]), video_grid_thw=grid(videos), second_per_grid_ts=seconds)
    return positions[:, 0]


def _check_separated(items: torch.Tensor, on_grid: torch.Tensor) -> None:
    """Refuse two grid items back to back (transformers groups consecutive image tokens into one image)."""
    prev = torch.cat([items.new_tensor([-1]), items[:-1]])
    prev_grid = torch.cat([on_grid.new_tensor([False]), on_grid[:-1]])
    if bool((on_grid & prev_grid & (items != prev)).any()):
        raise ValueError("two image/video items follow each other without a text token between them (Qwen2.5-VL's "
                         "chat template wraps each in <|vision_start|> ... <|vision_end|>); M-RoPE positions would "
                         "take them for one item")


def next_mrope_positions(positions: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The positions ``[3, B, 1]`` of the token after left-padded prompts with M-RoPE ``positions`` ``[3, B, N]``
    (``attention_mask`` ``[B, N]``, 1 on tokens; None: every column counts, as padding's 0 does not raise the
    maximum): one past the largest position of each row on all three streams, transformers' ``rope_deltas`` rule
    (decoding step ``k`` is at ``max + 1 + k``)."""
    masked = positions if attention_mask is None else positions.masked_fill(attention_mask[None] == 0, -1)
    return masked.amax(dim=(0, 2)).add(1).view(1, -1, 1).expand(3, -1, -1)
