"""M-RoPE positions of a Qwen2.5-Omni thinker document (images, videos, audio clips, and a video with its audio
track: one clip, time-aligned), computed by transformers, and the token layout of such a clip.

The one implementation is transformers' ``Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_rope_index``
(with its ``get_llm_pos_ids_for_vision`` and ``get_chunked_index``), called on the class with a stand-in holding the
config values it reads, as :mod:`plait.data.mrope` calls Qwen2.5-VL's. It reads the roles of the tokens from their
ids, so the document is rewritten into role ids first: each item's tokens become the image, video or audio
placeholder of the stand-in's config, the token before an item its start token (``<|vision_bos|>``,
``<|audio_bos|>``; a clip has both, in that order), every other token plain text. Positions: text counts on;
an image or video of grid ``(t, h, w)`` sits at ``(t_k, h / m, w / m)`` from its start (``t_k = k x
second_per_grid_t x position_id_per_seconds`` for a video's temporal patch ``k``); an audio clip's ``k`` features count
on like text. A clip's video and audio start at the same position and interleave by chunks of ``seconds_per_chunk``
seconds (:func:`clip_chunks`, the layout ``Qwen2_5OmniProcessor`` writes with ``load_audio_from_video``), so a
second of audio and the frames of that second share temporal positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Sequence

import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniPreTrainedModelForConditionalGeneration as _Thinker)

from plait.data.mrope import _merge_size

__all__ = ["OmniItem", "omni_positions", "clip_chunks", "clip_runs", "audio_frames_for", "omni_items"]

_TEXT, _IMAGE, _VIDEO, _AUDIO, _VSTART, _ASTART = 0, 1, 2, 3, 4, 5  # the stand-in's role ids


@dataclass(frozen=True)
class OmniItem:
    """One media item of a document, as :func:`omni_positions` positions it.

    Attributes:
        kind: ``"image"``, ``"video"`` or ``"audio"``.
        grid: ``(t, h, w)`` in patches (image, video); None for audio.
        second_per_grid_t: seconds of video per temporal patch (video); 0 otherwise.
        position_id_per_seconds: temporal positions per second (video; the thinker's 25).
        clip: for a video, the index of the audio item that is its audio track (``use_audio_in_video``); -1 none.
    """

    kind: str
    grid: tuple[int, int, int] | None = None
    second_per_grid_t: float = 0.0
    position_id_per_seconds: float = 25.0
    clip: int = -1


def audio_frames_for(tokens: int) -> int:
    """Mel frames ``f`` whose audio features number ``tokens`` (the inverse of ``((f - 1) // 2 + 1 - 2) // 2 + 1``:
    ``4 tokens - 1``), what ``get_rope_index`` takes as ``audio_seqlens``."""
    return 4 * int(tokens) - 1


def clip_chunks(grid: Sequence[int], merge: int, second_per_grid_t: float, audio_tokens: int,
                position_id_per_seconds: float, seconds_per_chunk: float) -> list[tuple[str, int]]:
    """The token layout of a clip (a video of ``grid`` ``(t, h, w)`` patches merged ``merge x merge`` and its audio
    track of ``audio_tokens`` features): ``[("video", n), ("audio", n), ...]`` chunk by chunk, each chunk the tokens of
    one ``seconds_per_chunk`` span (video first), by transformers' ``get_chunked_index`` as the thinker's
    ``get_rope_index`` splits them."""
    t, h, w = (int(g) for g in grid)
    per_t = (h // merge) * (w // merge)
    video_t = (torch.arange(t) * float(second_per_grid_t) * float(position_id_per_seconds)).long()
    video_t = video_t.repeat_interleave(per_t)
    step = int(position_id_per_seconds * seconds_per_chunk)
    video = _Thinker.get_chunked_index(None, video_t, step, 0)
    audio = _Thinker.get_chunked_index(None, torch.arange(int(audio_tokens)), step, 0)
    out: list[tuple[str, int]] = []
    for j in range(max(len(video), len(audio))):
        for kind, chunks in (("video", video), ("audio", audio)):
            if j < len(chunks) and chunks[j][1] > chunks[j][0]:
                out.append((kind, int(chunks[j][1] - chunks[j][0])))
    return out


def clip_runs(video: dict, video_tokens: int, audio_tokens: int) -> list[tuple[str, int]]:
    """:func:`clip_chunks` of a clip's processed video item (``image_grid_thw``, ``second_per_grid_t``,
    ``tokens_per_second``, ``seconds_per_chunk``) of ``video_tokens`` tokens and its audio track's ``audio_tokens``.

    Raises:
        ValueError: as :func:`omni_positions` for a grid that is not ``video_tokens`` merged blocks."""
    grid = [int(g) for g in torch.as_tensor(video["image_grid_thw"]).reshape(-1)]
    merge = _merge_size(grid, int(video_tokens), 0)
    return clip_chunks(grid, merge, float(video["second_per_grid_t"]), int(audio_tokens),
                       float(video["tokens_per_second"]), float(video["seconds_per_chunk"]))


def omni_items(items: Sequence[dict]) -> tuple[list[OmniItem], float] | None:
    """The :class:`OmniItem` of each processed item of a document (in item order: a clip's video item marked
    ``audio_track``, its audio item right after it) and the videos' ``seconds_per_chunk``; None when no item is a
    thinker's video (one whose timing has ``seconds_per_chunk``): images and audio clips are positioned alike by
    :func:`plait.data.mrope.mrope_positions`, videos are not (the thinker's text after a video continues past its
    largest position on all three streams)."""
    if not any("seconds_per_chunk" in it for it in items):
        return None
    out, chunk = [], 2.0
    for i, it in enumerate(items):
        grid = it.get("image_grid_thw")
        if grid is None:
            out.append(OmniItem("audio"))
            continue
        g = tuple(int(v) for v in torch.as_tensor(grid).reshape(-1))
        timed = "second_per_grid_t" in it
        chunk = float(it.get("seconds_per_chunk", chunk))
        out.append(OmniItem("video" if timed else "image", g, float(it.get("second_per_grid_t", 0.0)),
                            float(it.get("tokens_per_second", 25.0)), i + 1 if it.get("audio_track") else -1))
    return out, chunk


def omni_positions(input_ids: torch.Tensor, item_ids: torch.Tensor, items: Sequence[OmniItem],
                   seconds_per_chunk: float = 2.0) -> torch.Tensor:
    """M-RoPE positions ``[3, n]`` int64 of one document (module docstring), by the thinker's ``get_rope_index``.

    Args:
        input_ids: ``[n]`` token ids (only their count is read; roles come from ``item_ids``).
        item_ids: ``[n]``: -1 on text, else the index into ``items`` of the item the token belongs to.
        items: the document's items (a clip: its video names its audio item in ``clip``).
        seconds_per_chunk: the thinker's ``seconds_per_chunk``.

    Raises:
        ValueError: naming the item: tokens of an item not contiguous (a clip's: not in :func:`clip_chunks`'
            layout), an item without text tokens around it (one before and after; two for a clip, its start and
            end tokens), a grid whose token count is not ``t h w / m^2``, grid items of different merge sizes or
            videos of different ``position_id_per_seconds``, or a video without its audio track in a document whose
            other videos have theirs (transformers positions a document all one way).
    """
    items_t = item_ids.reshape(-1).long()
    n = int(input_ids.reshape(-1).numel())
    counts = [int((items_t == i).sum()) for i in range(len(items))]
    if not any(it.grid is not None and counts[i] for i, it in enumerate(items)):
        return torch.arange(n).expand(3, -1).clone()  # text and audio only: transformers' 1-D positions
    audio_of = {it.clip: i for i, it in enumerate(items) if it.kind == "video" and it.clip >= 0}
    spans = _spans(items_t, items, audio_of, counts)
    merges = {_merge_size(it.grid, counts[i], i) for i, it in enumerate(items) if it.grid is not None and counts[i]}
    if len(merges) != 1:
        raise ValueError(f"grid items of merge sizes {sorted(merges)} in one document")
    merge = merges.pop()
    videos = [i for i, _, _ in spans if items[i].kind == "video"]
    clips = [i for i in videos if items[i].clip >= 0]
    if clips and len(clips) != len(videos):
        silent = next(i for i in videos if items[i].clip < 0)
        raise ValueError(f"item {silent}: a video without its audio track in a document whose other videos have "
                         "theirs (the thinker positions a document's videos all with or all without audio)")
    rates = {float(items[i].position_id_per_seconds) for i in videos}
    if len(rates) > 1:
        raise ValueError(f"videos of position_id_per_seconds {sorted(rates)} in one document")
    roles = torch.full((n,), _TEXT, dtype=torch.long)
    for i, start, end in spans:
        kind = items[i].kind
        roles[start:end] = torch.where(items_t[start:end] == i, {"image": _IMAGE, "video": _VIDEO}.get(kind, _AUDIO),
                                       _AUDIO)
        if kind == "video" and items[i].clip >= 0:
            roles[start - 2], roles[start - 1] = _VSTART, _ASTART
            _check_clip(items_t[start:end], i, items[i].clip, items[i], merge, counts, seconds_per_chunk)
        else:
            roles[start - 1] = _ASTART if kind == "audio" else _VSTART
    holder = SimpleNamespace(
        spatial_merge_size=merge,
        config=SimpleNamespace(image_token_id=_IMAGE, video_token_id=_VIDEO, audio_token_id=_AUDIO,
                               vision_start_token_id=_VSTART, audio_start_token_id=_ASTART,
                               position_id_per_seconds=rates.pop() if rates else 25.0,
                               seconds_per_chunk=seconds_per_chunk),
        get_llm_pos_ids_for_vision=lambda *a: _Thinker.get_llm_pos_ids_for_vision(None, *a),
        get_chunked_index=lambda *a: _Thinker.get_chunked_index(None, *a))
    order = [i for i, _, _ in spans]
    audios = [j for i in order for j in ([i] if items[i].kind == "audio" else
                                         [items[i].clip] if items[i].kind == "video" and items[i].clip >= 0 else [])]

    def grid(kind: str) -> torch.Tensor | None:
        rows = [list(items[i].grid) for i in order if items[i].kind == kind]  # type: ignore[arg-type]
        return torch.tensor(rows, dtype=torch.long) if rows else None

    seconds = torch.tensor([float(items[i].second_per_grid_t) for i in videos]) if videos else None
    lens = torch.tensor([audio_frames_for(counts[j]) for j in audios]) if audios else None
    positions, _ = _Thinker.get_rope_index(holder, roles[None], grid("image"), grid("video"), None, bool(clips), lens,
                                           seconds)
    return positions[:, 0]


def _spans(items: torch.Tensor, kinds: Sequence[OmniItem], audio_of: dict[int, int], counts: list[int]
           ) -> list[tuple[int, int, int]]:
    """``(item, start, end)`` of each positioned item (a clip: its video, spanning its audio too) in document order.

    Raises:
        ValueError: as :func:`omni_positions` (contiguity, text around each item)."""
    n = int(items.numel())
    spans = []
    for i, item in enumerate(kinds):
        if not counts[i] or i in audio_of:
            continue
        where = torch.nonzero(items == i).flatten()
        if item.kind == "video" and item.clip >= 0:
            where = torch.nonzero((items == i) | (items == item.clip)).flatten()
        start, end = int(where[0]), int(where[-1]) + 1
        if end - start != where.numel():
            raise ValueError(f"item {i}: its tokens are not contiguous in the document")
        spans.append((i, start, end))
    spans.sort(key=lambda s: s[1])
    prev_end = 0
    for i, start, end in spans:
        around = 2 if kinds[i].kind == "video" and kinds[i].clip >= 0 else 1
        if start - around < prev_end or end + around > n:
            raise ValueError(f"item {i} ({kinds[i].kind}) needs {around} text token(s) before and after it (its start "
                             "and end tokens), apart from the other items' (<|vision_bos|> ... <|vision_eos|>, "
                             "<|audio_bos|> ... <|audio_eos|>)")
        prev_end = end + around
    return spans


def _check_clip(tokens: torch.Tensor, video: int, audio: int, item: OmniItem, merge: int, counts: list[int],
                seconds_per_chunk: float) -> None:
    """Refuse a clip whose video and audio tokens are not laid out as :func:`clip_chunks` says.

    Raises:
        ValueError: naming the video item."""
    want = clip_chunks(item.grid, merge, item.second_per_grid_t, counts[audio],  # type: ignore[arg-type]
                       item.position_id_per_seconds, seconds_per_chunk)
    got: list[tuple[str, int]] = []
    for t in tokens.tolist():
        kind = "video" if t == video else "audio"
        if got and got[-1][0] == kind:
            got[-1] = (kind, got[-1][1] + 1)
        else:
            got.append((kind, 1))
    merged: list[tuple[str, int]] = []
    for kind, k in want:  # consecutive chunks of one kind read as one run of tokens
        merged[-1:] = [(kind, merged[-1][1] + k)] if merged and merged[-1][0] == kind else merged[-1:] + [(kind, k)]
    if got != merged:
        raise ValueError(f"item {video}: the clip's video and audio tokens run {got}, not the interleaving by "
                         f"{seconds_per_chunk:g}-s chunks {merged} (audio item {audio})")
