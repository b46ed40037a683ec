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

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniPreTrainedModelForConditionalGeneration as _Thinker)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoePreTrainedModelForConditionalGeneration as _Thinker3, _get_feat_extract_output_lengths)

from plait.data.mrope import _merge_size, mrope_positions

__all__ = ["OmniItem", "omni_positions", "clip_chunks", "clip_in_time_order", "clip_runs", "audio_frames_for",
           "qwen3_audio_frames_for", "omni_items", "document_positions", "THINKERS", "clip_wrapper_error"]

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


def clip_in_time_order(grid: Sequence[int], merge: int, second_per_grid_t: float, audio_tokens: int,
                       position_id_per_seconds: float, seconds_per_chunk: float = 0.0) -> list[tuple[str, int]]:
    """The token layout of a Qwen3-Omni clip (as :func:`clip_chunks`; ``seconds_per_chunk`` unused): each temporal
    patch ``k`` of the video at time ``T_k = k x second_per_grid_t x position_id_per_seconds`` goes before the audio
    tokens ``a >= T_k`` (audio token ``a`` sits at time ``a``), the order ``Qwen3OmniMoeProcessor`` writes and the
    thinker's ``get_rope_index`` merges (a video token first on equal times); runs of one kind joined."""
    t, h, w = (int(g) for g in grid)
    per_t, audio = (h // merge) * (w // merge), int(audio_tokens)
    out: list[tuple[str, int]] = []

    def add(kind: str, n: int) -> None:
        if n > 0:
            out[-1:] = [(kind, out[-1][1] + n)] if out and out[-1][0] == kind else out[-1:] + [(kind, n)]

    done = 0
    for k in range(t):
        before = min(audio, math.ceil(k * float(second_per_grid_t) * float(position_id_per_seconds)))
        add("audio", before - done)
        done = max(done, before)
        add("video", per_t)
    add("audio", audio - done)
    return out


def qwen3_audio_frames_for(tokens: int, n_window: int = 50) -> int:
    """The fewest mel frames whose Qwen3-Omni audio features number ``tokens`` (the inverse of transformers'
    ``_get_feat_extract_output_lengths``: ``13`` features per full ``2 n_window``-frame chunk, then the tail's)."""
    chunk = 2 * int(n_window)
    full = int(_get_feat_extract_output_lengths(torch.tensor(chunk), n_window))
    tail = _get_feat_extract_output_lengths(torch.arange(chunk), n_window)
    rest = int(tokens) % full
    return chunk * (int(tokens) // full) + int(torch.nonzero(tail == rest)[0])


@dataclass(frozen=True)
class _Rules:
    """A thinker's rules: whose ``get_rope_index``, its clip layout, mel frames of an audio item's token count, and
    the config fields its ``get_rope_index`` reads besides the role ids; ``wrapper``: the two tokens a record writes
    before and the two after a clip (vision start, audio start ... audio end, vision end)."""

    thinker: Any
    layout: Callable[..., list[tuple[str, int]]]
    frames_for: Callable[[int], int]
    config: Callable[[float], dict[str, Any]]
    needs_mask: bool
    wrapper: tuple[tuple[str, str], tuple[str, str]]


THINKERS = {
    "qwen2_5_omni": _Rules(_Thinker, clip_chunks, audio_frames_for, lambda chunk: {"seconds_per_chunk": chunk}, False,
                           (("<|vision_bos|>", "<|audio_bos|>"), ("<|audio_eos|>", "<|vision_eos|>"))),
    "qwen3_omni_moe": _Rules(_Thinker3, clip_in_time_order, qwen3_audio_frames_for,
                             lambda chunk: {"audio_config": SimpleNamespace(n_window=50)}, True,
                             (("<|vision_start|>", "<|audio_start|>"), ("<|audio_end|>", "<|vision_end|>"))),
}
"""The thinkers whose positions :func:`omni_positions` computes, by the name their videos' timing carries."""


def clip_runs(video: dict, video_tokens: int, audio_tokens: int) -> list[tuple[str, int]]:
    """The token layout (:func:`clip_chunks`, or :func:`clip_in_time_order` for a ``thinker = "qwen3_omni_moe"``
    video) of a clip's processed video item (``image_grid_thw``, ``second_per_grid_t``, ``tokens_per_second``,
    ``seconds_per_chunk``) of ``video_tokens`` tokens and its audio track's ``audio_tokens``.

    Raises:
        ValueError: as :func:`omni_positions` for a grid that is not ``video_tokens`` merged blocks."""
    grid = [int(g) for g in torch.as_tensor(video["image_grid_thw"]).reshape(-1)]
    merge = _merge_size(grid, int(video_tokens), 0)
    layout = THINKERS[video.get("thinker", "qwen2_5_omni")].layout
    return layout(grid, merge, float(video["second_per_grid_t"]), int(audio_tokens),
                  float(video["tokens_per_second"]), float(video["seconds_per_chunk"]))


def clip_wrapper_error(tokenizer: Any, ids: Sequence[int], start: int, end: int, video: dict) -> str | None:
    """Why the clip of tokens ``ids[start:end]`` (its processed video item ``video``) is not in its thinker's layout
    (:data:`THINKERS`): the two tokens before it and the two after must be vision start, audio start ... audio end,
    vision end (``<|vision_bos|><|audio_bos|>`` ... ``<|audio_eos|><|vision_eos|>`` for Qwen2.5-Omni,
    ``<|vision_start|><|audio_start|>`` ... ``<|audio_end|><|vision_end|>`` for Qwen3-Omni), as the thinker's
    processor writes them; None when they are."""
    (b0, b1), (e0, e1) = THINKERS[video.get("thinker", "qwen2_5_omni")].wrapper
    before, after = list(ids[max(start - 2, 0):start]), list(ids[end:end + 2])
    if before + after == tokenizer.convert_tokens_to_ids([b0, b1, e0, e1]):
        return None
    found = "<clip>".join("".join(tokenizer.convert_ids_to_tokens(side)) for side in (before, after))
    return (f"a video with its audio track is written {b0}{b1}<clip>{e0}{e1} (its thinker's layout), found {found} "
            "around it")


def omni_items(items: Sequence[dict]) -> tuple[list[OmniItem], float, str] | None:
    """The :class:`OmniItem` of each processed item of a document (in item order: a clip's video item marked
    ``audio_track``, its audio item right after it), the videos' ``seconds_per_chunk`` and their thinker (a
    :data:`THINKERS` name, ``"qwen2_5_omni"`` unless the timing names another); None when no item is a
    thinker's video (one whose timing has ``seconds_per_chunk``): images and audio clips are positioned alike by
    :func:`plait.data.mrope.mrope_positions`, videos are not (the thinker's text after a video continues past its
    largest position on all three streams)."""
    if not any("seconds_per_chunk" in it for it in items):
        return None
    out, chunk = [], 2.0
    thinker = next((it["thinker"] for it in items if "thinker" in it), "qwen2_5_omni")
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
    return out, chunk, thinker


def document_positions(input_ids: torch.Tensor, item_ids: torch.Tensor, items: Sequence[dict]) -> torch.Tensor | None:
    """The M-RoPE positions ``[3, n]`` of one document whose processed ``items`` (in item order) include a grid item
    (``image_grid_thw``): a thinker's (:func:`omni_items`, :func:`omni_positions`) when one of its videos is there,
    else Qwen2.5-VL's (:func:`plait.data.mrope.mrope_positions`); None without a grid item (1-D positions).

    Raises:
        ValueError: as those functions, naming the item (e.g. two items without text tokens between them).
    """
    if not any("image_grid_thw" in it for it in items):
        return None
    clips = omni_items(items)
    if clips is not None:
        return omni_positions(input_ids, item_ids, *clips)
    grids, timing = [], []
    for item in items:
        grid = item.get("image_grid_thw")
        grids.append(None if grid is None else [int(g) for g in torch.as_tensor(grid).reshape(-1)])
        video = "second_per_grid_t" in item  # a Qwen2.5-VL video with its timing: positioned as a video
        timing.append((item["second_per_grid_t"], item["tokens_per_second"]) if video else None)
    return mrope_positions(input_ids, item_ids, grids, timing)


def omni_positions(input_ids: torch.Tensor, item_ids: torch.Tensor, items: Sequence[OmniItem],
                   seconds_per_chunk: float = 2.0, thinker: str = "qwen2_5_omni") -> torch.Tensor:
    """M-RoPE positions ``[3, n]`` of one document (module docstring), by the thinker's ``get_rope_index``: int64,
    or float32 as transformers gives them when they are not whole numbers (a Qwen3-Omni video whose
    ``second_per_grid_t x position_id_per_seconds`` is not whole: its temporal positions and the text after it are
    fractional, Qwen2.5-Omni's are rounded down by its own ``get_rope_index``).

    Args:
        input_ids: ``[n]`` token ids (only their count is read; roles come from ``item_ids``).
        item_ids: ``[n]``: -1 on text, else the index into ``items`` of the item the token belongs to.
        items: the document's items (a clip: its video names its audio item in ``clip``).
        seconds_per_chunk: the thinker's ``seconds_per_chunk`` (Qwen2.5-Omni's clip chunks).
        thinker: whose ``get_rope_index`` and clip layout (:data:`THINKERS`): ``"qwen2_5_omni"`` (clips interleaved
            by chunks, :func:`clip_chunks`) or ``"qwen3_omni_moe"`` (clips in time order,
            :func:`clip_in_time_order`; its positions are fractional when ``second_per_grid_t x
            position_id_per_seconds`` is not a whole number).

    Raises:
        ValueError: naming the item: tokens of an item not contiguous (a clip's: not in :func:`clip_chunks`'
            layout), an item without text tokens around it (one before and after; two for a clip, its start and
            end tokens), a grid whose token count is not ``t h w / m^2``, grid items of different merge sizes or
            videos of different ``position_id_per_seconds``, or a video without its audio track in a document whose
            other videos have theirs (transformers positions a document all one way).
    """
    rules = THINKERS[thinker]
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
            _check_clip(items_t[start:end], i, items[i].clip, items[i], merge, counts, seconds_per_chunk, rules.layout)
        else:
            roles[start - 1] = _ASTART if kind == "audio" else _VSTART
    holder = SimpleNamespace(
        spatial_merge_size=merge,
        config=SimpleNamespace(image_token_id=_IMAGE, video_token_id=_VIDEO, audio_token_id=_AUDIO,
                               vision_start_token_id=_VSTART, audio_start_token_id=_ASTART,
                               position_id_per_seconds=rates.pop() if rates else 25.0,
                               **rules.config(seconds_per_chunk)),
        get_llm_pos_ids_for_vision=lambda *a: rules.thinker.get_llm_pos_ids_for_vision(None, *a),
        get_chunked_index=lambda *a: rules.thinker.get_chunked_index(None, *a))
    order = [i for i, _, _ in spans]
    audios = [j for i in order for j in ([i] if items[i].kind == "audio" else
                                         [items[i].clip] if items[i].kind == "video" and items[i].clip >= 0 else [])]

    def grid(kind: str) -> torch.Tensor | None:
        rows = [list(items[i].grid) for i in order if items[i].kind == kind]  # type: ignore[arg-type]
        return torch.tensor(rows, dtype=torch.long) if rows else None

    seconds = torch.tensor([float(items[i].second_per_grid_t) for i in videos]) if videos else None
    lens = torch.tensor([rules.frames_for(counts[j]) for j in audios]) if audios else None
    mask = torch.ones(1, n, dtype=torch.long) if rules.needs_mask else None
    positions, _ = rules.thinker.get_rope_index(holder, roles[None], grid("image"), grid("video"), mask, bool(clips),
                                                lens, seconds)
    positions = positions[:, 0]
    return positions.long() if torch.equal(positions, positions.round()) else positions.float()


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
                seconds_per_chunk: float, layout: Callable[..., list[tuple[str, int]]] = clip_chunks) -> None:
    """Refuse a clip whose video and audio tokens are not laid out as ``layout`` (the thinker's: :func:`clip_chunks`,
    :func:`clip_in_time_order`) says.

    Raises:
        ValueError: naming the video item."""
    want = layout(item.grid, merge, item.second_per_grid_t, counts[audio],  # type: ignore[arg-type]
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
        raise ValueError(f"item {video}: the clip's video and audio tokens run {got}, not the thinker's interleaving "
                         f"{merged} (audio item {audio})")
