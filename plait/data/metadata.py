"""The metadata pass: per record what the planners and the loader need, without decoding pixels or waveforms.

For every row of a :class:`~plait.data.sources.RecordSource` the pass validates the record (structure, chat
template, placeholder counts, media headers, length) and computes its :class:`~plait.data.processing.SampleMeta`:
LLM length, text tokens, target tokens and per media item the placeholder tokens it fills. Image sizes come from
the file header (``PIL.Image.open(...).size`` reads no pixels); the size the image processor outputs for that
input size is found once per distinct size by processing a blank image of it (exact for any processor whose
output shape depends only on the input size, as resize / center-crop processors do). Audio lengths come from
the header (``wave`` for WAV, as the decoder reads it; ``soundfile.info`` for other formats). A video's frame count,
rate and frame size come from its container and stream headers (:func:`plait.data.video.read_video_header`: no
frame is decoded), its sampled frames from :func:`plait.data.video.sample_indices`; its audio track, when the job
takes it (``video.audio``), is decoded (the sample count after resampling is what the count needs). The result equals
what :class:`~plait.data.processing.MultimodalProcessor` computes when it decodes the sample (the loader checks
that at load time, :meth:`plait.data.loader.MultimodalDataset.load`).

Work is split into chunks of rows: DP rank ``r`` of ``w`` takes chunks ``r, r + w, ...`` and computes them in
``workers`` torch DataLoader worker processes; the ranks' results are gathered with ``all_gather_object``
(inside :func:`this_process_only` one process does every chunk and gathers nothing). The
gathered table (:class:`MetadataTable`, numpy arrays: about 40 bytes per record plus its id) is cached on disk
under a key of the data files' identity (:meth:`RecordSource.identity`: path, size, mtime) and every processor
setting that changes the counts (:func:`metadata_key`); the media files read are stamped (size, mtime) in the
cache, so a changed image or clip makes the cache stale too. A stale cache is never reused: its key differs, or
its stamps do, and the pass runs again.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
import wave
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image

from plait.data.chat_template import render_prompt, render_with_assistant_mask
from plait.data.processing import (MultimodalProcessor, SampleMeta, check_clip_video, decode_reason,
                                   process_image)
from plait.data.progress import Progress
from plait.data.sources import MediaBytes, RecordSource, SampleError, parse_record, path_note, record_id
from plait.data.video import VideoHeader, load_audio_track, read_video_header

__all__ = ["SkippedSample", "MetadataTable", "metadata_key", "metadata_pass", "record_metadata", "default_cache_dir",
           "METADATA_VERSION", "this_process_only"]

log = logging.getLogger(__name__)

METADATA_VERSION = 2  # 2: mixture media paths resolved absolute (caches of 1 may hold rows refused by the old rule)
"""Bumped whenever the pass computes anything differently: part of every cache key."""
CHUNK = 2048
"""Rows per unit of work (one DataLoader item)."""


@dataclass(frozen=True)
class SkippedSample:
    """A record left out with ``data.on_error = "skip"``: its id, ``file:line`` and the reason."""

    id: str
    source: str
    reason: str


# ---------------------------------------------------------------------------------------------- one record
class _Headers:
    """Per-process memo of media headers (by path) and of the processed image size per input size."""

    def __init__(self) -> None:
        self.images: dict[str, tuple[int, int]] = {}
        self.audios: dict[str, tuple[int, int]] = {}
        self.videos: dict[str, VideoHeader] = {}
        self.tracks: dict[str | bytes, int] = {}  # a video's audio track: samples at the audio branch's rate
        self.processed: dict[tuple[int, int, int], tuple[int, int]] = {}


def _image_size(item: str | MediaBytes, memo: _Headers) -> tuple[int, int]:
    """``(width, height)`` from the image header (no pixel decode). Raises SampleError like ``load_image``."""
    key = None if isinstance(item, bytes) else str(item)
    if key is not None and key in memo.images:
        return memo.images[key]
    try:
        with Image.open(io.BytesIO(item) if isinstance(item, bytes) else item) as img:
            size = img.size
    except FileNotFoundError as exc:
        raise SampleError(f"image file {item} does not exist{path_note(str(item))}") from exc
    except Exception as exc:  # PIL raises several types for unreadable headers
        raise SampleError(f"cannot decode image {item}: {exc}") from exc
    if key is not None:
        memo.images[key] = size
    return size


def _audio_header(item: str | MediaBytes, memo: _Headers) -> tuple[int, int]:
    """``(frames, sampling rate in Hz)`` from the audio header. Raises SampleError like ``load_audio``."""
    key = None if isinstance(item, bytes) else str(item)
    if key is not None and key in memo.audios:
        return memo.audios[key]
    if key is not None and not Path(key).is_file():
        raise SampleError(f"audio file {item} does not exist{path_note(key)}")
    is_wav = item[:4] == b"RIFF" if isinstance(item, bytes) else str(key).lower().endswith(".wav")
    try:
        if is_wav:
            with wave.open(io.BytesIO(item) if isinstance(item, bytes) else key, "rb") as w:
                if w.getsampwidth() != 2:
                    raise ValueError(f"only 16-bit PCM WAV is supported, got {8 * w.getsampwidth()}-bit")
                header = (w.getnframes(), w.getframerate())
        else:
            import soundfile

            info = soundfile.info(io.BytesIO(item) if isinstance(item, bytes) else key)
            header = (int(info.frames), int(info.samplerate))
    except Exception as exc:
        raise SampleError(f"cannot decode audio {item}: {decode_reason(exc, key if key is not None else item)}") \
            from exc
    if header[0] == 0:
        raise SampleError(f"audio file {item} has no samples")
    if key is not None:
        memo.audios[key] = header
    return header


def _video_header(item: str | MediaBytes, memo: _Headers) -> VideoHeader:
    """The video's :class:`VideoHeader` (no frame decoded), memoised by path. Raises SampleError like
    ``load_video``."""
    key = None if isinstance(item, bytes) else str(item)
    if key is not None and key in memo.videos:
        return memo.videos[key]
    header = read_video_header(item)
    if key is not None:
        memo.videos[key] = header
    return header


def _processed_image_size(spec: Any, size: tuple[int, int], memo: _Headers) -> tuple[int, int]:
    """``(H, W)`` of ``spec.hf_processor``'s output for an input of ``size = (width, height)``."""
    key = (id(spec), *size)
    if key not in memo.processed:
        blank = Image.new("RGB", size)
        memo.processed[key] = process_image(spec.hf_processor, blank)[1]
    return memo.processed[key]


def _item_tokens(kind: str, spec: Any, item: str | MediaBytes, memo: _Headers,
                 audio: Any = None) -> list[int | tuple[str, int]]:
    """Placeholder tokens of each encoder item of one media item (one for an image or a clip, one per frame for a
    video with the default encoding), from its header; the checks of the decoding path. A video with its audio track
    (``spec.video.audio``; ``audio``: the audio branch's spec) adds ``(audio branch, tokens)`` of the decoded track."""
    if kind == "video":
        header = _video_header(item, memo)
        frames = len(spec.video.frame_indices(header, item))
        frame = _processed_image_size(spec, (header.width, header.height), memo)
        try:
            sizes = spec.video.encoding.sizes(frames, frame)
        except ValueError as exc:  # the family's encoding refuses the frames
            raise SampleError(f"video {item}: {exc}") from exc
        if spec.video.audio and audio is not None:  # the track decoded: its samples after resampling count
            check_clip_video(spec.video, len(sizes), spec.video.encoding.timing(1.0), item)
            key = item if isinstance(item, bytes) else str(item)
            if key not in memo.tracks:
                memo.tracks[key] = len(load_audio_track(item, int(audio.hf_processor.sampling_rate), spec.video))
            return [*_counts(spec, sizes, item), (audio.encoder, *_counts(audio, [memo.tracks[key]], item))]
    elif kind == "image":
        sizes = [_processed_image_size(spec, _image_size(item, memo), memo)]
    else:
        frames, rate = _audio_header(item, memo)
        expected = int(spec.hf_processor.sampling_rate)
        if rate != expected:
            raise SampleError(f"audio {item} is sampled at {rate} Hz; the feature extractor expects {expected} Hz")
        sizes = [frames]
    return _counts(spec, sizes, item)


def _counts(spec: Any, sizes: list[Any], item: Any) -> list[int | tuple[str, int]]:
    """The branch's feature count of each size, errors naming ``item``."""
    try:
        return [spec.feature_count(size) for size in sizes]
    except ValueError as exc:
        raise SampleError(f"{item}: {exc}") from exc


def record_metadata(processor: MultimodalProcessor, raw: Any, prompt_only: bool = False,
                    memo: _Headers | None = None) -> SampleMeta:
    """The :class:`SampleMeta` ``processor(raw, prompt_only)`` would give, from media headers only.

    Raises:
        SampleError: for what the processor refuses and headers show (template failure, no answer tokens, a
            placeholder/item count mismatch, a modality without encoder, a missing or unreadable media header,
            a wrong sampling rate, a too long clip or sequence), naming the record and its file and line.
    """
    try:
        return _record_metadata(processor, raw, prompt_only, memo or _Headers())
    except SampleError as exc:
        raise SampleError(f"record {raw.id!r} ({raw.source}): {exc}") from exc


def _record_metadata(processor: MultimodalProcessor, raw: Any, prompt_only: bool, memo: _Headers) -> SampleMeta:
    messages = list(raw.messages[:-1] if prompt_only else raw.messages)
    if prompt_only:
        ids = render_prompt(processor.tokenizer, messages)
        answer = [0] * len(ids)
    else:
        ids, answer = render_with_assistant_mask(processor.tokenizer, messages)
        if not any(answer):
            raise SampleError("the chat template marked no assistant tokens (empty answer?)")
    processor.check_placeholders(raw.media, ids)
    audio = processor.specs.get("audio")
    counts = {pid: [_item_tokens(kind, spec, it, memo, audio) for it in raw.media.get(kind, ())]
              for kind, (spec, pid, _) in processor.placeholders().items()}
    return _expanded_meta(processor, raw, ids, answer, counts)


def _expanded_meta(processor: MultimodalProcessor, raw: Any, ids: list[int], answer: list[int],
                   counts: dict[int, list[list[int | tuple[str, int]]]]) -> SampleMeta:
    """Counts of the expanded sequence (each placeholder repeated by its encoder items' tokens; ``counts``: per
    placeholder id, per occurrence, the tokens of each encoder item), as the processor lays it out:
    ``target_tokens`` counts answer tokens at positions >= 1 (a label is the next token)."""
    encoder = {pid: spec.encoder for spec, pid, _ in processor.placeholders().values()}
    seen = dict.fromkeys(encoder, 0)
    items: list[tuple[str, int]] = []
    length = text = targets = 0
    first_answer = None
    for tok, is_answer in zip(ids, answer):
        if tok in encoder:
            for count in counts[tok][seen[tok]]:  # (branch, n): a video's audio track, for the audio branch
                name, n = count if isinstance(count, tuple) else (encoder[tok], count)
                items.append((name, n))
                first_answer = 0 if first_answer is None and n else first_answer
                length += n
            seen[tok] += 1
            continue
        first_answer = int(is_answer) if first_answer is None else first_answer
        length, text, targets = length + 1, text + 1, targets + int(is_answer)
    if length > processor.max_length:
        raise SampleError(f"{length} tokens is longer than data.max_length={processor.max_length}")
    return SampleMeta(raw.id, raw.task, length, text, targets - (first_answer or 0), tuple(items))


# ---------------------------------------------------------------------------------------------- chunks of rows
@dataclass
class _Chunk:
    """The metadata of rows ``[start, start + n)``: per row the id (``id_len`` -1: no valid id), task, whether
    it is usable, its counts and items; the errors ``(row, id or where, where, message)``; the media stamps."""

    start: int
    id_blob: bytes
    id_len: np.ndarray
    id_hash: np.ndarray
    tasks: list[str]
    task_idx: np.ndarray
    ok: np.ndarray
    counts: np.ndarray
    n_items: np.ndarray
    item_branch: np.ndarray
    item_tokens: np.ndarray
    errors: list[tuple[int, str, str, str]]
    media: dict[str, tuple[int, int]]


class _ChunkTask(torch.utils.data.Dataset):
    """DataLoader dataset: item ``c`` is the :class:`_Chunk` of rows ``[c * chunk, (c + 1) * chunk)``."""

    def __init__(self, source: RecordSource, processor: MultimodalProcessor, prompt_only: bool, rows: int,
                 chunk: int) -> None:
        self.source, self.processor, self.prompt_only = source, processor, prompt_only
        self.rows, self.chunk = rows, chunk
        self.branches = [s.encoder for s in processor.specs.values()]
        self.memo = _Headers()
        self.stamped: set[str] = set()

    def __len__(self) -> int:
        return -(-self.rows // self.chunk)

    def __getitem__(self, c: int) -> _Chunk:
        start, stop = c * self.chunk, min(self.rows, (c + 1) * self.chunk)
        ids: list[bytes | None] = []
        tasks: dict[str, int] = {}
        rows: list[tuple[int, int, int, int, int]] = []  # task, ok, length, text, targets
        n_items, branch, tokens, errors = [], [], [], []
        for i in range(start, stop):
            rid, meta, error = self._row(i)
            ids.append(None if rid is None else rid.encode())
            if meta is None:
                rows.append((0, 0, 0, 0, 0))
                n_items.append(0)
                errors.append((i, *error))
                continue
            t = tasks.setdefault(meta.task, len(tasks))
            rows.append((t, 1, meta.length, meta.text_tokens, meta.target_tokens))
            n_items.append(len(meta.items))
            branch += [self.branches.index(e) for e, _ in meta.items]
            tokens += [n for _, n in meta.items]
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
        return _Chunk(start, b"".join(x or b"" for x in ids), np.asarray([-1 if x is None else len(x) for x in ids],
                      dtype=np.int32), np.asarray([_hash(x) for x in ids], dtype=np.uint64), list(tasks),
                      table[:, 0].astype(np.int16), table[:, 1].astype(bool), table[:, 2:].astype(np.int32),
                      np.asarray(n_items, dtype=np.int32), np.asarray(branch, dtype=np.int8),
                      np.asarray(tokens, dtype=np.int32), errors, self._stamps())

    def _row(self, i: int) -> tuple[str | None, SampleMeta | None, tuple[str, str, str] | None]:
        """``(id or None, meta or None, (id or where, where, message) or None)`` of row ``i``."""
        obj, where, error = self.source[i]
        rid = None
        try:
            if error is not None:
                raise SampleError(f"{where}: {error}")
            raw = parse_record(obj, where, self.source.base_dir)
            rid = raw.id
            return rid, record_metadata(self.processor, raw, self.prompt_only, self.memo), None
        except SampleError as exc:
            return rid, None, (_id_or_place(obj, where), where, str(exc))

    def _stamps(self) -> dict[str, tuple[int, int]]:
        """``path -> (size, mtime_ns)`` of the media files this process read since its last chunk."""
        out = {}
        for path in {*self.memo.images, *self.memo.audios, *self.memo.videos} - self.stamped:
            self.stamped.add(path)
            st = os.stat(path)
            out[path] = (st.st_size, st.st_mtime_ns)
        return out


def _hash(rid: bytes | None) -> int:
    """64-bit hash of an id (0 for none): duplicate ids are found by sorting these."""
    return 0 if rid is None else int.from_bytes(hashlib.blake2b(rid, digest_size=8).digest(), "little")


def _id_or_place(obj: dict[str, Any] | None, where: str) -> str:
    """A skipped record's id, or ``where`` (``file:line``) when it has no valid one."""
    try:
        return record_id(obj, where) if obj is not None else where
    except SampleError:
        return where


def _identity(x: Any) -> Any:
    return x


# ---------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class MetadataTable:
    """The metadata of a source's usable samples, in row order, as numpy arrays (``n`` samples).

    Attributes:
        key: the cache key it was computed under (:func:`metadata_key`).
        rows: ``[n]`` int64 row of each sample in the source.
        counts: ``[n, 3]`` int32 LLM length, text tokens and target tokens (tokens).
        item_offsets: ``[n + 1]`` int64: sample ``i``'s media items are ``item_offsets[i]:item_offsets[i + 1]``.
        item_branch: ``[items]`` int8 index into ``branches``; item_tokens: ``[items]`` int32 placeholder tokens.
        id_blob: ``[bytes]`` uint8 UTF-8 ids; id_offsets: ``[n + 1]`` int64 (sample ``i``'s id is the slice).
        task_idx: ``[n]`` int16 index into ``tasks``.
        tasks, branches: the task and encoder branch names.
        skipped: the bad records, in row order.
        media: ``path -> (size in bytes, mtime in ns)`` of every media file read (staleness check).
    """

    key: str
    rows: np.ndarray
    counts: np.ndarray
    item_offsets: np.ndarray
    item_branch: np.ndarray
    item_tokens: np.ndarray
    id_blob: np.ndarray
    id_offsets: np.ndarray
    task_idx: np.ndarray
    tasks: tuple[str, ...]
    branches: tuple[str, ...]
    skipped: tuple[SkippedSample, ...]
    media: dict[str, tuple[int, int]]

    def __len__(self) -> int:
        return len(self.rows)

    def id(self, i: int) -> str:
        """Sample ``i``'s record id."""
        return self.id_blob[self.id_offsets[i]:self.id_offsets[i + 1]].tobytes().decode()

    def items(self, i: int) -> tuple[tuple[str, int], ...]:
        """``((encoder branch, placeholder tokens), ...)`` of sample ``i``'s media items, in placeholder order."""
        lo, hi = self.item_offsets[i], self.item_offsets[i + 1]
        return tuple((self.branches[b], int(n)) for b, n in zip(self.item_branch[lo:hi], self.item_tokens[lo:hi]))

    def meta(self, i: int) -> SampleMeta:
        """Sample ``i``'s :class:`SampleMeta` (equal to the one processing the sample gives)."""
        length, text, targets = (int(x) for x in self.counts[i])
        return SampleMeta(self.id(i), self.tasks[self.task_idx[i]], length, text, targets, self.items(i))

    def save(self, path: Path) -> None:
        """Write the table to ``path`` (``.npz``, no pickle) atomically (a temporary file, then renamed)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = {"key": self.key, "tasks": self.tasks, "branches": self.branches, "media": self.media,
                 "skipped": [[s.id, s.source, s.reason] for s in self.skipped]}
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, rows=self.rows, counts=self.counts, item_offsets=self.item_offsets,
                     item_branch=self.item_branch, item_tokens=self.item_tokens, id_blob=self.id_blob,
                     id_offsets=self.id_offsets, task_idx=self.task_idx,
                     extra=np.frombuffer(json.dumps(extra).encode(), dtype=np.uint8))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, key: str) -> MetadataTable | None:
        """The table cached at ``path``, or None when it was computed under another key or a media file it read
        changed (size or mtime) or is gone: a stale cache is never used."""
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError) as exc:
            log.warning("metadata cache %s unreadable (%s): computing again", path, exc)
            return None
        extra = json.loads(arrays.pop("extra").tobytes())
        if extra["key"] != key:
            return None
        media = {p: tuple(v) for p, v in extra["media"].items()}
        for p, stamp in media.items():
            try:
                st = os.stat(p)
            except OSError:
                st = None
            if st is None or (st.st_size, st.st_mtime_ns) != stamp:
                log.warning("metadata cache %s is stale (%s changed): computing again", path, p)
                return None
        return cls(key=key, tasks=tuple(extra["tasks"]), branches=tuple(extra["branches"]), media=media,
                   skipped=tuple(SkippedSample(*s) for s in extra["skipped"]), **arrays)


def _assemble(chunks: list[_Chunk], source: RecordSource, branches: tuple[str, ...], key: str) -> MetadataTable:
    """One table from the chunks of every rank (duplicate ids become errors: the first use of an id wins)."""
    chunks = sorted(chunks, key=lambda c: c.start)
    cat = np.concatenate
    tasks: dict[str, int] = {}
    task_idx = cat([np.asarray([tasks.setdefault(t, len(tasks)) for t in c.tasks], dtype=np.int16)[c.task_idx]
                    if c.tasks else c.task_idx for c in chunks])
    id_len, ok = cat([c.id_len for c in chunks]), cat([c.ok for c in chunks])
    blob = np.frombuffer(b"".join(c.id_blob for c in chunks), dtype=np.uint8)
    starts = np.concatenate([[0], np.cumsum(np.maximum(id_len, 0))])
    errors = {e[0]: e[1:] for c in chunks for e in c.errors}
    for row, first in _duplicates(cat([c.id_hash for c in chunks]), id_len, blob, starts):
        rid = blob[starts[row]:starts[row + 1]].tobytes().decode()
        where, first_where = source[row][1], source[first][1]
        errors[row] = (rid, where, f"record {rid!r} ({where}): the id is already used at {first_where}")
        ok[row] = False
    n_items = cat([c.n_items for c in chunks])
    item_row = np.repeat(np.arange(len(ok)), n_items)
    keep = np.nonzero(ok)[0]
    kept_len = np.maximum(id_len, 0)[keep]
    return MetadataTable(
        key=key, rows=keep.astype(np.int64), counts=cat([c.counts for c in chunks])[keep],
        item_offsets=np.concatenate([[0], np.cumsum(n_items[keep])]).astype(np.int64),
        item_branch=cat([c.item_branch for c in chunks])[ok[item_row]],
        item_tokens=cat([c.item_tokens for c in chunks])[ok[item_row]],
        id_blob=blob[np.repeat(ok, np.maximum(id_len, 0))],
        id_offsets=np.concatenate([[0], np.cumsum(kept_len)]).astype(np.int64), task_idx=task_idx[keep],
        tasks=tuple(tasks), branches=branches, skipped=tuple(SkippedSample(*errors[r]) for r in sorted(errors)),
        media={p: s for c in chunks for p, s in c.media.items()},
    )


def _duplicates(hashes: np.ndarray, id_len: np.ndarray, blob: np.ndarray,
                starts: np.ndarray) -> list[tuple[int, int]]:
    """``(row, row of the first use of its id)`` of every later use of an id, in row order."""
    rows = np.nonzero(id_len >= 0)[0]
    _, inverse, counts = np.unique(hashes[rows], return_inverse=True, return_counts=True)
    out = []
    first: dict[bytes, int] = {}
    for row in rows[counts[inverse] > 1]:  # rows whose hash is shared: compare the ids themselves
        rid = blob[starts[row]:starts[row + 1]].tobytes()
        if rid in first:
            out.append((int(row), first[rid]))
        else:
            first[rid] = int(row)
    return out


# ---------------------------------------------------------------------------------------------- key and pass
def metadata_key(source: RecordSource, processor: MultimodalProcessor, prompt_only: bool, rows: int) -> str:
    """SHA-256 (hex) of everything the metadata depends on: :data:`METADATA_VERSION`, the source's identity
    (files, sizes, mtimes), the rows read, ``prompt_only``, the tokenizer (class, vocabulary and rules,
    special tokens, chat template), ``max_length`` and per encoder branch its placeholder, feature-count rule,
    the settings of its image processor / feature extractor and its video settings (placeholder, fps, max
    frames, encoding)."""
    tok = processor.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    specs = [[s.encoder, s.modality, s.placeholder, s.placeholder_id, repr(s.feature_count),
              s.hf_processor.to_json_string() if hasattr(s.hf_processor, "to_json_string") else repr(s.hf_processor),
              repr(s.video)]
             for s in processor.specs.values()]
    desc = {"version": METADATA_VERSION, "source": source.identity(), "rows": rows, "prompt_only": prompt_only,
            "tokenizer": [type(tok).__name__, hashlib.sha256(vocab.encode()).hexdigest(), tok.chat_template,
                          sorted(tok.special_tokens_map.items(), key=str)],
            "max_length": processor.max_length, "specs": specs}
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/plait/metadata`` (``~/.cache/plait/metadata`` without it)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "plait" / "metadata"


_THIS_PROCESS_ONLY: ContextVar[bool] = ContextVar("plait_metadata_this_process_only", default=False)
"""True inside :func:`this_process_only`."""


@contextmanager
def this_process_only() -> Iterator[None]:
    """Inside, every :func:`metadata_pass` runs in this process alone, as without a process group: all rows here,
    no collective, the cache (if any) read and written by this process. For data one rank builds alone while the
    others wait, e.g. the profile of ``parallel.plan = "auto"`` (``plait.commands.train.resolve_auto``): a
    collective pass there waits for ranks that never enter it."""
    token = _THIS_PROCESS_ONLY.set(True)
    try:
        yield
    finally:
        _THIS_PROCESS_ONLY.reset(token)


def metadata_pass(source: RecordSource, processor: MultimodalProcessor, *, prompt_only: bool = False,
                  max_rows: int | None = None, workers: int = 0, cache_dir: str | Path | None = None,
                  progress: bool = False, chunk: int = CHUNK) -> MetadataTable:
    """The :class:`MetadataTable` of the first ``max_rows`` rows of ``source`` (all without it): from the cache
    under ``cache_dir`` when fresh there on every rank, else computed (module docstring) and written by rank 0.
    Collective when ``torch.distributed`` is initialized with several ranks: every rank calls it (inside
    :func:`this_process_only`: never).

    Args:
        source: the records.
        processor: the processor whose counts the metadata must equal.
        prompt_only: metadata of the prompts (validation by generation).
        workers: DataLoader worker processes per rank (0: in this process).
        cache_dir: folder of the cache (None: no cache).
        progress: a progress bar with rate and ETA (only when stderr is a terminal).
        chunk: rows per unit of work.

    Raises:
        ValueError: for a negative ``workers`` or a non-positive ``chunk``.
    """
    if workers < 0 or chunk <= 0:
        raise ValueError(f"workers must be >= 0 and chunk > 0, got {workers}, {chunk}")
    rows = len(source) if max_rows is None else min(len(source), max_rows)
    key = metadata_key(source, processor, prompt_only, rows)
    path = Path(cache_dir) / f"{_safe(source.name)}-{key[:24]}.npz" if cache_dir else None
    table = MetadataTable.load(path, key) if path is not None and path.is_file() else None
    if all(_gather(table is not None)):
        return table  # type: ignore[return-value]
    rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    task = _ChunkTask(source, processor, prompt_only, rows, chunk)
    mine = list(range(rank, len(task), world))
    loader = torch.utils.data.DataLoader(task, batch_size=None, sampler=mine, num_workers=workers,
                                         collate_fn=_identity, prefetch_factor=4 if workers else None,
                                         generator=torch.Generator().manual_seed(0))
    if workers:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    total = sum(min(rows, (c + 1) * chunk) - c * chunk for c in mine)
    bar = Progress(total, f"metadata {source.name}", "record", progress, leave=False)
    done, start = [], time.perf_counter()
    for part in loader:
        done.append(part)
        bar.update(len(part.id_len))
    bar.close()
    chunks = [c for parts in _gather(done) for c in parts]
    table = _assemble(chunks, source, tuple(task.branches), key)
    seconds = time.perf_counter() - start
    log.info("metadata pass of %s: %d records in %.1f s (%.0f records/s on rank %d of %d), %d usable, %d bad%s",
             source.name, rows, seconds, total / max(seconds, 1e-9), rank, world, len(table), len(table.skipped),
             f"; cached in {path}" if path is not None else "")
    if path is not None and rank == 0:
        table.save(path)
    return table


def _distributed() -> bool:
    """Whether the pass is split over, and gathered from, several ranks."""
    return not _THIS_PROCESS_ONLY.get() and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gather(obj: Any) -> list[Any]:
    """``obj`` of every rank (``[obj]`` in one process)."""
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or "data"
