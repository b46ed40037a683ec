"""Random packed multimodal mask metadata and a brute-force mask, shared by the attention tests."""

from __future__ import annotations

import numpy as np
import torch

from plait.attention.masks import MaskInfo


def random_info(seed: int, batch: int, n: int, mode: str, max_pad: int = 4, max_docs: int = 3) -> MaskInfo:
    """Rows of contiguous documents (random lengths), 0-2 contiguous items per document, trailing padding."""
    rng = np.random.default_rng(seed)
    docs = np.full((batch, n), -1, dtype=np.int64)
    items = np.full((batch, n), -1, dtype=np.int64)
    pos = np.zeros((batch, n), dtype=np.int64)
    for b in range(batch):
        real = n - int(rng.integers(0, min(max_pad, n - 1) + 1))
        cuts = np.sort(rng.choice(np.arange(1, real), size=min(real - 1, int(rng.integers(0, max_docs))),
                                  replace=False))
        bounds = np.r_[0, cuts, real]
        next_item = 0
        for d, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            docs[b, s:e] = d
            pos[b, s:e] = np.arange(e - s)
            cursor = s
            for _ in range(int(rng.integers(0, 3))):
                if cursor >= e:
                    break
                start = int(rng.integers(cursor, e))
                stop = int(rng.integers(start + 1, e + 1))
                items[b, start:stop] = next_item
                next_item += 1
                cursor = stop
    return MaskInfo(torch.from_numpy(docs), torch.from_numpy(items), torch.from_numpy(pos), mode)


def brute_mask(info: MaskInfo) -> torch.Tensor:
    """The mask semantics written out pair by pair (independent of plait's vectorised code)."""
    b, n = info.shape
    docs, items = info.document_ids.tolist(), info.item_ids.tolist()
    out = torch.zeros(b, n, n, dtype=torch.bool)
    for r in range(b):
        for q in range(n):
            for k in range(n):
                if docs[r][q] < 0:
                    out[r, q, k] = k == q
                    continue
                same_doc = docs[r][q] == docs[r][k]
                same_item = items[r][q] >= 0 and items[r][q] == items[r][k]
                bidir = info.mode == "bidirectional_items" and same_item
                out[r, q, k] = same_doc and (k <= q or bidir)
    return out
