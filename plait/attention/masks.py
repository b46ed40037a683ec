"""Multimodal attention masks from O(N) per-token metadata.

A batch of packed rows is described per token by three int64 tensors of shape ``[B, N]`` (written by the
collator; a token sees the earlier tokens of its own document, never another packed document's):

- ``document_ids``: 0, 1, 2, ... per packed document of the row, -1 on padding;
- ``item_ids``: -1 on text tokens, otherwise an id unique within the row for each modality item
  (one image, one audio clip);
- ``position_ids``: position inside the token's document (restarts at 0 per document).

Semantics (query token q, key token k of the same row):

- q sees k when both are in the same document and ``k <= q`` (causal, by token index);
- packed documents never see each other;
- with ``mode="bidirectional_items"`` the tokens of one modality item also see each other, earlier or later
  (Gemma-3 / prefix-LM style; Cornstarch, Jang et al., arXiv 2503.11367); with ``mode="causal"``
  (LLaVA-style) they do not;
- padding sees nothing and is seen by nothing, except that a padding query sees itself, so that no softmax
  row is empty (no NaN) in any backend;
- a layer with a sliding window ``w`` (Gemma 3's and Mistral's local layers: the ``sliding_window`` the layer
  passes to its attention function) further sees only keys ``k > q - w`` (token indices), applied after the item
  rule, as transformers composes it (``AND(sliding_window, OR(causal, items))``).

The mask is never stored as an N x N tensor outside tests: :func:`build_mask_mod` reads the metadata inside
``torch.nn.attention.flex_attention``, and :func:`block_work` counts attended pairs in O(N).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch

__all__ = [
    "MASK_MODES",
    "MaskInfo",
    "block_work",
    "build_block_mask",
    "build_mask_mod",
    "dense_mask",
    "query_chunk_spans",
    "token_work",
]

MASK_MODES = ("causal", "bidirectional_items")
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, eq=False)
class MaskInfo:
    """Per-token mask metadata of one batch (O(N) memory).

    Attributes:
        document_ids: int64 ``[B, N]``; document index inside its row, -1 on padding.
        item_ids: int64 ``[B, N]``; modality item id (unique within a row), -1 on text and padding.
        positions: int64 ``[B, N]``; position of the token inside its document (RoPE position). Carried for
            sharding; the mask itself orders tokens by index.
        mode: ``"causal"`` or ``"bidirectional_items"``.

    Instances are immutable; a private cache (not part of equality or repr) keeps block masks built from
    this metadata so that every layer of a forward pass reuses them.

    Raises:
        ValueError: on a mode not in :data:`MASK_MODES`, tensors that are not 2-D integer tensors of one
            shape and device, an item token on padding, or an item id spread over two documents of a row.
    """

    document_ids: torch.Tensor
    item_ids: torch.Tensor
    positions: torch.Tensor
    mode: str = "causal"
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MASK_MODES:
            raise ValueError(f"MaskInfo.mode must be one of {MASK_MODES}, got {self.mode!r}")
        ref = self.document_ids
        for name in ("document_ids", "item_ids", "positions"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"MaskInfo.{name} must be a 2-D [B, N] tensor, got {_describe(t)}")
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(f"MaskInfo.{name} must be an integer tensor, got dtype {t.dtype}")
            if t.shape != ref.shape or t.device != ref.device:
                raise ValueError(
                    f"MaskInfo.{name} has shape {tuple(t.shape)} on {t.device}, "
                    f"document_ids has {tuple(ref.shape)} on {ref.device}"
                )

    @classmethod
    def from_batch(cls, batch: Mapping[str, Any], mode: str = "causal", validate: bool = True) -> "MaskInfo":
        """Build from a collated batch holding ``document_ids``, ``item_ids`` and ``position_ids`` ``[B, N]``.

        ``validate=True`` also checks that items lie on non-padding tokens of a single document (one
        host sync).

        Raises:
            ValueError: on a missing key or inconsistent metadata (see the class docstring).
        """
        missing = [k for k in ("document_ids", "item_ids", "position_ids") if k not in batch]
        if missing:
            raise ValueError(f"MaskInfo.from_batch: batch lacks key(s) {missing}")
        info = cls(
            document_ids=batch["document_ids"].long(),
            item_ids=batch["item_ids"].long(),
            positions=batch["position_ids"].long(),
            mode=mode,
        )
        if validate:
            info.validate()
        return info

    @classmethod
    def from_padding(cls, attention_mask: torch.Tensor | None, shape: tuple[int, int] | None = None,
                     device: torch.device | str | None = None) -> "MaskInfo":
        """One causal document per row; ``attention_mask`` ``[B, N]`` (1/True = real token) marks padding.

        With ``attention_mask=None`` every token of ``shape=(B, N)`` is real (plain causal LM attention).

        Raises:
            ValueError: when neither ``attention_mask`` nor ``shape`` is given.
        """
        if attention_mask is None:
            if shape is None:
                raise ValueError("MaskInfo.from_padding needs attention_mask or shape=(B, N)")
            real = torch.ones(shape, dtype=torch.bool, device=device)
        else:
            real = attention_mask.to(device=device or attention_mask.device).bool()
        docs = torch.where(real, 0, -1).long()
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        return cls(docs, torch.full_like(docs, -1), positions, "causal")

    @property
    def shape(self) -> tuple[int, int]:
        """``(B, N)``: batch rows and tokens per row."""
        return tuple(self.document_ids.shape)

    def to(self, device: torch.device | str) -> "MaskInfo":
        """Copy of the metadata on ``device`` (the block-mask cache is not copied)."""
        return MaskInfo(self.document_ids.to(device), self.item_ids.to(device), self.positions.to(device),
                        self.mode)

    def validate(self) -> None:
        """Check that item tokens are real tokens and that each item lies in one document of its row.

        Raises:
            ValueError: naming the first offending row and item.
        """
        docs, items = self.document_ids, self.item_ids
        bad = (items >= 0) & (docs < 0)
        if bool(bad.any()):
            row, tok = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"MaskInfo: row {row} token {tok} has item id {int(items[row, tok])} on padding")
        for row in range(docs.shape[0]):
            sel = items[row] >= 0
            pairs = torch.unique(torch.stack([items[row][sel], docs[row][sel]]), dim=1)
            ids, counts = torch.unique(pairs[0], return_counts=True)
            if bool((counts > 1).any()):
                item = int(ids[counts > 1][0])
                raise ValueError(f"MaskInfo: row {row} item {item} spans more than one document")


def _describe(t: Any) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_q_global(info: MaskInfo, q_global: torch.Tensor | None) -> None:
    if q_global is None:
        return
    if q_global.dim() != 2 or q_global.shape[0] != info.shape[0]:
        raise ValueError(f"q_global must be [B={info.shape[0]}, Nq], got shape {tuple(q_global.shape)}")


def build_mask_mod(info: MaskInfo, q_global: torch.Tensor | None = None, window: int | None = None) -> MaskMod:
    """``mask_mod(b, h, q_idx, kv_idx) -> bool`` for ``torch.nn.attention.flex_attention``.

    ``window``: a sliding-window layer's window (keys ``kv > q - window`` only); None for a global layer.

    Keys index the full row (``kv_idx`` in ``[0, N)``). Queries index the full row too, or, with
    ``q_global`` (int64 ``[B, Nq]``), a subset of it: query ``q_idx`` is token ``q_global[b, q_idx]``
    (what a context-parallel rank holds). Indices past the end are clamped, so the function never reads out
    of bounds when flex evaluates a partial last block.

    Raises:
        ValueError: when ``q_global`` is not ``[B, Nq]``.
    """
    _check_q_global(info, q_global)
    docs, items = info.document_ids, info.item_ids
    n = docs.shape[1]
    bidirectional = info.mode == "bidirectional_items"
    nq = q_global.shape[1] if q_global is not None else n

    def mask_mod(b, h, q_idx, kv_idx):
        kv = kv_idx.clamp(max=n - 1)
        q = q_idx.clamp(max=nq - 1)
        if q_global is not None:
            q = q_global[b, q]
        doc_q = docs[b, q]
        visible = (doc_q == docs[b, kv]) & (doc_q >= 0) & (kv <= q)
        if bidirectional:
            item_q = items[b, q]
            visible = visible | ((item_q == items[b, kv]) & (item_q >= 0))
        if window is not None:
            visible = visible & (kv > q - window)
        return visible | ((doc_q < 0) & (kv == q))

    return mask_mod


def dense_mask(info: MaskInfo, q_global: torch.Tensor | None = None,
               kv_range: tuple[int, int] | None = None, window: int | None = None) -> torch.Tensor:
    """Dense boolean mask ``[B, Nq, Nk]`` (True = attend); ``window`` as :func:`build_mask_mod`.

    Queries are the full row (``Nq = N``) or the tokens ``q_global`` (int64 ``[B, Nq]``); keys are the full
    row or the tokens ``kv_range = (start, end)`` (``Nk = end - start``). O(Nq * Nk) memory: a reference for
    tests and the block-wise SDPA fallback, not for a whole long sequence.

    Raises:
        ValueError: when ``q_global`` is not ``[B, Nq]`` or ``kv_range`` is not inside ``[0, N]``.
    """
    _check_q_global(info, q_global)
    b, n = info.shape
    start, end = kv_range if kv_range is not None else (0, n)
    if not 0 <= start <= end <= n:
        raise ValueError(f"dense_mask: kv_range {kv_range} not inside [0, {n}]")
    device = info.document_ids.device
    kv = torch.arange(start, end, device=device)
    q = q_global if q_global is not None else torch.arange(n, device=device).expand(b, n)
    docs_q = info.document_ids.gather(1, q)[:, :, None]
    docs_k = info.document_ids[:, None, start:end]
    mask = (docs_q == docs_k) & (docs_q >= 0) & (kv[None, None, :] <= q[:, :, None])
    if info.mode == "bidirectional_items":
        items_q = info.item_ids.gather(1, q)[:, :, None]
        mask |= (items_q == info.item_ids[:, None, start:end]) & (items_q >= 0)
    if window is not None:
        mask &= kv[None, None, :] > q[:, :, None] - window
    pad_self = (docs_q < 0) & (kv[None, None, :] == q[:, :, None])
    return mask | pad_self


def build_block_mask(info: MaskInfo, q_global: torch.Tensor | None = None, block_size: int = 128,
                     compile_mask: bool | None = None, window: int | None = None):
    """Flex ``BlockMask`` of ``info`` (queries = ``q_global`` or the full row; ``window`` as
    :func:`build_mask_mod`), cached on ``info``.

    ``compile_mask=None`` compiles the block-mask construction on CUDA (no N x N tensor) and evaluates it
    eagerly elsewhere (it then holds an ``Nq x N`` boolean mask transiently).

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` of shape ``[B, 1, Nq, N]``.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = info.shape
    nq = q_global.shape[1] if q_global is not None else n
    device = info.document_ids.device
    if compile_mask is None:
        compile_mask = device.type == "cuda"
    qkey = (id(q_global), q_global.data_ptr()) if q_global is not None else None
    key = ("block", qkey, nq, block_size, bool(compile_mask), window)
    cached = info._cache.get(key)
    if cached is None:
        mask = create_block_mask(build_mask_mod(info, q_global, window), b, None, nq, n, device=device,
                                 BLOCK_SIZE=block_size, _compile=compile_mask)
        cached = info._cache[key] = (mask, q_global)  # keeping q_global alive keeps its id unique
    return cached[0]


def _visible_bounds(info: MaskInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, int64 ``[B, N]``: the lowest and highest key index it may see (a superset bound)."""
    docs, items = info.document_ids, info.item_ids
    b, n = info.shape
    idx = torch.arange(n, device=docs.device).expand(b, n)
    first = torch.full((b, n + 1), n, dtype=torch.long, device=docs.device)
    first = first.scatter_reduce(1, docs + 1, idx, reduce="amin")
    lo = torch.where(docs >= 0, first.gather(1, docs + 1), idx)
    hi = idx
    if info.mode == "bidirectional_items":
        last = torch.full((b, n + 1), -1, dtype=torch.long, device=docs.device)
        last = last.scatter_reduce(1, items + 1, idx, reduce="amax")
        hi = torch.where(items >= 0, torch.maximum(idx, last.gather(1, items + 1)), idx)
    return lo, hi


def query_chunk_spans(info: MaskInfo, q_global: torch.Tensor | None = None,
                      chunk: int = 512) -> list[tuple[int, int, int, int]]:
    """Key span of each chunk of ``chunk`` consecutive queries: ``[(q_start, q_end, kv_start, kv_end)]``.

    Every key a query of the chunk may see (in any row) lies in ``[kv_start, kv_end)``, so attention of the
    chunk against that key span with the :func:`dense_mask` of the span is exact. Queries are the full row
    or ``q_global`` ``[B, Nq]``. Cached on ``info``; one host sync when computed.

    Raises:
        ValueError: on ``chunk < 1`` or a bad ``q_global``.
    """
    if chunk < 1:
        raise ValueError(f"query_chunk_spans: chunk must be >= 1, got {chunk}")
    _check_q_global(info, q_global)
    key = ("spans", (id(q_global), q_global.data_ptr()) if q_global is not None else None, chunk)
    if key in info._cache:
        return info._cache[key][0]
    lo, hi = _visible_bounds(info)
    if q_global is not None:
        lo, hi = lo.gather(1, q_global), hi.gather(1, q_global)
    b, nq = lo.shape
    pad = (-nq) % chunk
    lo = torch.nn.functional.pad(lo, (0, pad), value=info.shape[1]).view(b, -1, chunk).amin(-1).amin(0)
    hi = torch.nn.functional.pad(hi, (0, pad), value=-1).view(b, -1, chunk).amax(-1).amax(0) + 1
    spans = [(i * chunk, min((i + 1) * chunk, nq), a, z) for i, (a, z) in enumerate(zip(lo.tolist(), hi.tolist()))]
    info._cache[key] = (spans, q_global)
    return spans


def _rank_and_size(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each element: its rank among equal keys (by index) and the count of equal keys."""
    n = keys.shape[0]
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    sizes = np.diff(np.r_[starts, n])
    group = np.repeat(np.arange(starts.size), sizes)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n) - starts[group]
    size = np.empty(n, dtype=np.int64)
    size[order] = sizes[group]
    return rank, size


def token_work(info: MaskInfo, row: int | None = None) -> np.ndarray:
    """Attended (query, key) pairs per query token, int64 ``[N]``, in O(N log N) time and O(N) memory.

    A real token sees the tokens of its document up to itself (its rank in the document + 1) and, in
    ``"bidirectional_items"`` mode, the later tokens of its own item; a padding token sees itself (1).
    ``row=None`` sums over the batch rows (for an assignment shared by all rows).

    Raises:
        ValueError: on a row index outside ``[0, B)``.
    """
    b, _ = info.shape
    rows = range(b) if row is None else [row]
    if row is not None and not 0 <= row < b:
        raise ValueError(f"token_work: row {row} outside [0, {b})")
    docs_all = info.document_ids.detach().cpu().numpy()
    items_all = info.item_ids.detach().cpu().numpy()
    total = np.zeros(info.shape[1], dtype=np.int64)
    for r in rows:
        docs, items = docs_all[r], items_all[r]
        rank_doc, _ = _rank_and_size(docs)
        work = np.where(docs >= 0, rank_doc + 1, 1)
        if info.mode == "bidirectional_items":
            rank_item, size_item = _rank_and_size(items)
            work = work + np.where(items >= 0, size_item - rank_item - 1, 0)
        total += work
    return total


def block_work(info: MaskInfo, block_size: int = 128, row: int | None = None) -> np.ndarray:
    """Attention work per query block: attended (q, k) pairs of the block's queries, int64 ``[ceil(N/bs)]``.

    Blocks are consecutive ``block_size`` tokens; the last one may be shorter. This is the per-block
    attention cost the token distributor balances (plait/planner/token_distributor.py); it refines the
    per-tile (non-empty tile count) weight of Cornstarch (Jang et al., arXiv 2503.11367) to pairs.
    ``row=None`` sums over rows.

    Raises:
        ValueError: on ``block_size < 1`` or a bad row.
    """
    if block_size < 1:
        raise ValueError(f"block_work: block_size must be >= 1, got {block_size}")
    work = token_work(info, row)
    starts = np.arange(0, work.shape[0], block_size)
    return np.add.reduceat(work, starts) if work.size else np.zeros(0, dtype=np.int64)

