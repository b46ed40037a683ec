"""Wire format of one pipeline message: an int64 header describing a payload, and (gloo) one packed byte buffer.

A payload maps each module of the sending (activations) or receiving (gradients) stage to a list of tensors (or
None: "no gradient"). The header (slot 0 is its own length) gives, per module, the tensor count and each tensor's
ndim, dtype index, ``requires_grad`` and shape (ndim -1 for None). An absent modality is a module with zero
tensors, so a branch without input in a microbatch still exchanges an (empty) message.

Packed form (:func:`pack_payload`, gloo on CPU): one uint8 buffer: int64 ``[total bytes, bytes of the first
part, *header]``, then each tensor's bytes, 8-byte aligned. The first ``min(total, capacity)`` bytes fill the
receive the peer posted ahead; :func:`unpack` returns the tensors as views of the buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["HEADER_SLOTS", "Payload", "TensorSpec", "decode_header", "encode_header", "pack", "pack_payload",
           "payload_tensors", "unpack"]

HEADER_SLOTS = 64
"""int64 slots of a header message on non-packed backends (a longer header continues in a second message)."""

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8)
Payload = Mapping[str, Sequence[torch.Tensor | None]]
TensorSpec = tuple[torch.dtype, list[int], bool]  # dtype, shape, requires_grad (the sender has a graph)


def encode_header(modules: Sequence[str], payload: Payload) -> list[int]:
    """The int64 header of ``payload`` over ``modules`` (module docstring); slot 0 is the header's length."""
    body: list[int] = []
    for module in modules:
        tensors = payload.get(module, [])
        body.append(len(tensors))
        for t in tensors:
            body += [-1] if t is None else [t.dim(), DTYPES.index(t.dtype), int(t.requires_grad), *t.shape]
    return [len(body) + 1, *body]


def decode_header(modules: Sequence[str], header: Sequence[int]) -> dict[str, list[TensorSpec | None]]:
    """Per module, the :data:`TensorSpec` (None for "no gradient") of each tensor of an :func:`encode_header`."""
    out: dict[str, list[TensorSpec | None]] = {}
    pos = 1
    for module in modules:
        count, pos = header[pos], pos + 1
        specs: list[TensorSpec | None] = []
        for _ in range(count):
            ndim = header[pos]
            if ndim < 0:
                specs.append(None)
                pos += 1
                continue
            specs.append((DTYPES[header[pos + 1]], list(header[pos + 3 : pos + 3 + ndim]), bool(header[pos + 2])))
            pos += 3 + ndim
        out[module] = specs
    return out


def payload_tensors(modules: Sequence[str], payload: Payload) -> list[torch.Tensor]:
    """The non-empty tensors of ``payload`` in header order, detached and contiguous (what goes on the wire)."""
    tensors = [t.detach().contiguous() for m in modules for t in payload.get(m, []) if t is not None]
    return [t for t in tensors if t.numel()]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def pack(header: list[int], tensors: Sequence[torch.Tensor], capacity: int) -> torch.Tensor:
    """One uint8 buffer: int64 ``[total bytes, bytes of the first part, *header]``, then each tensor's bytes
    (8-byte aligned). The first ``min(total, capacity)`` bytes fill the receiver's pre-posted receive."""
    head = 8 * (2 + len(header))
    total = head + sum(_aligned(t.numel() * t.element_size()) for t in tensors)
    buf = torch.empty(total, dtype=torch.uint8)
    buf[:head].view(torch.int64).copy_(torch.tensor([total, min(total, capacity), *header], dtype=torch.int64))
    offset = head
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        buf[offset : offset + nbytes].copy_(t.reshape(-1).view(torch.uint8))
        offset += _aligned(nbytes)
    return buf


def pack_payload(modules: Sequence[str], payload: Payload, capacity: int) -> torch.Tensor:
    """:func:`pack` of ``payload``'s header and tensors over ``modules``."""
    return pack(encode_header(modules, payload), payload_tensors(modules, payload), capacity)


def unpack(buf: torch.Tensor, modules: Sequence[str]) -> dict[str, list[torch.Tensor | None]]:
    """The payload of a :func:`pack` buffer: tensors are views of ``buf`` (no copy).

    Raises:
        RuntimeError: when the header and the buffer's size disagree.
    """
    ints = buf[:16].view(torch.int64).tolist()
    header_len = int(buf[16:24].view(torch.int64).item())
    header = buf[16 : 16 + 8 * header_len].view(torch.int64).tolist()
    offset = 16 + 8 * header_len
    out: dict[str, list[torch.Tensor | None]] = {}
    for module, specs in decode_header(modules, header).items():
        out[module] = []
        for spec in specs:
            if spec is None:
                out[module].append(None)
                continue
            dtype, shape, grad = spec
            t = torch.empty(shape, dtype=dtype)
            if t.numel():
                nbytes = t.numel() * t.element_size()
                t = buf[offset : offset + nbytes].view(dtype).view(shape)
                offset += _aligned(nbytes)
            out[module].append(t.requires_grad_(grad))
    if offset != ints[0]:
        raise RuntimeError(f"pipeline message of {ints[0]} bytes decoded to {offset} bytes: header and payload "
                           "disagree")
    return out
