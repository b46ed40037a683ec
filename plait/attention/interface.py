"""plait attention for Hugging Face causal LMs, registered through transformers' ``AttentionInterface``.

How it hooks in (transformers 5.x, no modeling code copied): every HF attention layer calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, attention_mask,
dropout=..., scaling=..., **kwargs)`` with query ``[B, H, Nq, D]``, key/value ``[B, Hkv, N, D]`` and the
``**kwargs`` given to ``model(...)``. plait registers two implementations:

- ``"plait"``: ``torch.nn.attention.flex_attention`` with a block mask built from the O(N) metadata
  (compiled on CUDA; eager on CPU, where flex has no backward: with gradients it uses the SDPA path);
- ``"plait_sdpa"``: ``scaled_dot_product_attention`` over chunks of queries, each against the key span it
  can see, with a dense mask of that chunk only (exact; memory O(chunk * span)).

The mask comes from a :class:`~plait.attention.masks.MaskInfo` passed as ``model(..., plait_mask=info)``.
Context parallelism hooks in through ``plait_cp=shard``: any object with the method of
:class:`ContextParallelShard`, which the layer then calls instead of :func:`plait_attention` (plait's is
:class:`plait.parallel.context.CPShard`, whose ``attention`` all-gathers K/V over the CP group). This module
never imports the parallel layer: the shard brings its attention with it. For these names plait
also registers an ``AttentionMaskInterface`` entry that only forwards the 2-D padding mask, so HF never
builds an N x N mask. Without ``plait_mask`` a layer falls back to plain causal (or, for non-causal
modules, bidirectional) attention with the 2-D padding mask.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from plait.attention.masks import MaskInfo, build_block_mask, dense_mask, query_chunk_spans

__all__ = [
    "PLAIT_IMPLEMENTATIONS",
    "ContextParallelShard",
    "plait_attention",
    "plait_attention_forward",
    "plait_sdpa_attention_forward",
    "register_plait_attention",
    "resolve_implementation",
    "use_plait_attention",
]

PLAIT_IMPLEMENTATIONS = {"flex": "plait", "sdpa": "plait_sdpa"}
_BACKENDS = tuple(PLAIT_IMPLEMENTATIONS)
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "position_bias")
_COMPILED_FLEX: Any = None
_WARNED: set[str] = set()


class ContextParallelShard(Protocol):
    """What a layer needs of a ``plait_cp=`` kwarg: this rank's share of the tokens and how to attend with it.

    ``plait.parallel.context.CPShard`` is the implementation; a test may pass a stand-in.
    """

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, info: MaskInfo, *,
                  scale: float | None, backend: str, dropout: float, window: int | None = None) -> torch.Tensor:
        """Attention of this rank's queries ``[B, H, n_local, D]`` against the keys/values of all ranks (this
        rank's ``key``/``value`` ``[B, Hkv, n_local, D]``), masked by ``info`` (the whole rows); returns
        ``[B, H, n_local, Dv]``. ``scale``, ``backend``, ``dropout``, ``window`` as :func:`plait_attention`
        (``window`` is passed only by a sliding-window layer)."""
        ...


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def _check_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, info: MaskInfo,
                  q_global: torch.Tensor | None) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"plait attention: query/key/value must be [B, H, N, D], got "
                         f"{tuple(query.shape)}/{tuple(key.shape)}/{tuple(value.shape)}")
    b, h, nq, _ = query.shape
    if key.shape[0] != b or key.shape[2] != value.shape[2] or key.shape[1] != value.shape[1]:
        raise ValueError(f"plait attention: key {tuple(key.shape)} / value {tuple(value.shape)} do not match "
                         f"query {tuple(query.shape)}")
    if h % key.shape[1]:
        raise ValueError(f"plait attention: {h} query heads not a multiple of {key.shape[1]} key/value heads")
    if info.shape != (b, key.shape[2]):
        raise ValueError(f"plait attention: plait_mask covers {info.shape} tokens, keys are "
                         f"{(b, key.shape[2])} (B, N)")
    expected = q_global.shape[1] if q_global is not None else key.shape[2]
    if nq != expected:
        raise ValueError(f"plait attention: {nq} queries, mask expects {expected}")


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any,
          scale: float | None, compile_flex: bool | None) -> torch.Tensor:
    """flex_attention, compiled (once) by default on CUDA only; GQA native for power-of-two head counts."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    heads = query.shape[1]
    gqa = heads != key.shape[1]
    if gqa and heads & (heads - 1):
        key, value, gqa = _repeat_kv(key, heads), _repeat_kv(value, heads), False
    fn = flex_attention
    if compile_flex or (compile_flex is None and query.device.type == "cuda"):
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(flex_attention)
        fn = _COMPILED_FLEX
    return fn(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def _chunked_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, info: MaskInfo,
                  q_global: torch.Tensor | None, scale: float | None, dropout: float,
                  chunk: int, window: int | None = None) -> torch.Tensor:
    """SDPA per chunk of queries against the key span it can see (exact, O(chunk * span) mask memory)."""
    gqa = query.shape[1] != key.shape[1]
    outputs = []
    for qs, qe, ks, ke in query_chunk_spans(info, q_global, chunk):
        qg = q_global[:, qs:qe] if q_global is not None else _arange_rows(info, qs, qe)
        mask = dense_mask(info, qg, kv_range=(ks, ke), window=window)[:, None]
        outputs.append(F.scaled_dot_product_attention(
            query[:, :, qs:qe], key[:, :, ks:ke], value[:, :, ks:ke], attn_mask=mask,
            dropout_p=dropout, scale=scale, enable_gqa=gqa))
    if not outputs:
        return query.new_zeros(*query.shape[:3], value.shape[-1])
    return torch.cat(outputs, dim=2)


def _arange_rows(info: MaskInfo, start: int, end: int) -> torch.Tensor:
    idx = torch.arange(start, end, device=info.document_ids.device)
    return idx.expand(info.shape[0], end - start)


def plait_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, info: MaskInfo,
                    q_global: torch.Tensor | None = None, scale: float | None = None,
                    backend: str = "flex", dropout: float = 0.0, chunk: int = 128,
                    compile_flex: bool | None = None, window: int | None = None) -> torch.Tensor:
    """Masked attention of ``query`` against the keys of the full rows, mask from ``info``.

    Args:
        query: ``[B, H, Nq, D]``; token ``q_global[b, i]`` of the row (or token ``i`` when ``q_global`` is
            None, then ``Nq = N``).
        key, value: ``[B, Hkv, N, D]`` / ``[B, Hkv, N, Dv]``, all tokens of the rows in order
            (``H % Hkv == 0``: grouped-query attention).
        info: mask metadata ``[B, N]``.
        q_global: optional int64 ``[B, Nq]`` global token index of each query (context parallelism).
        scale: softmax scale (default ``D ** -0.5``).
        backend: ``"flex"`` (flex_attention; on CPU with gradients it uses ``"sdpa"``, since flex has no
            CPU backward) or ``"sdpa"`` (chunked SDPA).
        dropout: attention dropout probability (``"sdpa"`` only).
        chunk: queries per SDPA call (``"sdpa"``).
        compile_flex: run flex_attention through ``torch.compile`` (default: on CUDA only; on CPU the
            first call compiles for tens of seconds, the eager CPU path materialises all scores).
        window: a sliding-window layer's window (keys ``k > q - window`` only, after the item rule); None: global.

    Returns:
        ``[B, H, Nq, Dv]`` attention output.

    Raises:
        ValueError: on an unknown backend, inconsistent shapes, or dropout with flex.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"plait attention: backend must be one of {_BACKENDS}, got {backend!r}")
    _check_shapes(query, key, value, info, q_global)
    if backend == "flex" and query.device.type == "cpu" and torch.is_grad_enabled() and any(
            t.requires_grad for t in (query, key, value)):
        _warn_once("cpu_flex", "plait attention: flex_attention has no backward on CPU; using chunked SDPA")
        backend = "sdpa"
    if backend == "sdpa":
        return _chunked_sdpa(query, key, value, info, q_global, scale, dropout, chunk, window)
    if dropout > 0:
        raise ValueError("plait attention: flex backend has no dropout; set attention_dropout=0 or use plait_sdpa")
    return _flex(query, key, value, build_block_mask(info, q_global, window=window), scale, compile_flex)


def _default_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scale: float | None, dropout: float,
                       backend: str, is_causal: bool | None, window: int | None = None) -> torch.Tensor:
    """No ``plait_mask``: causal LM attention (or bidirectional for non-causal modules) with 2-D padding, within
    ``window`` keys of a sliding-window layer."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    b, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask[:, :, :, :nk]
    elif causal and nq == nk:
        info = MaskInfo.from_padding(attention_mask, shape=(b, nk), device=query.device)
        return plait_attention(query, key, value, info, scale=scale, backend=backend, dropout=dropout,
                               window=window)
    else:
        keys = torch.arange(nk, device=query.device)
        mask = torch.ones(b, 1, nq, nk, dtype=torch.bool, device=query.device)
        if causal:  # queries are the last nq of the nk positions (KV cache)
            rows = (keys[nk - nq:] if nq <= nk else keys)[None, None, :, None]
            mask &= keys[None, None, None, :] <= rows
            if window is not None:
                mask &= keys[None, None, None, :] > rows - window
        if attention_mask is not None:
            mask &= attention_mask[:, None, None, -nk:].bool()
    gqa = query.shape[1] != key.shape[1]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale,
                                          enable_gqa=gqa)


def _forward(backend: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None,
             dropout: float, kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"plait attention does not support {name}={kwargs[name]!r} "
                             f"(layer {type(module).__name__}); use another attn_implementation")
    info, shard = kwargs.get("plait_mask"), kwargs.get("plait_cp")
    window = kwargs.get("sliding_window")
    if shard is not None:
        if info is None:
            raise ValueError("plait attention: plait_cp needs plait_mask (the MaskInfo of the whole rows)")
        out = shard.attention(query, key, value, info, scale=scaling, backend=backend, dropout=dropout,
                              **({} if window is None else {"window": window}))
    elif info is not None:
        out = plait_attention(query, key, value, info, scale=scaling, backend=backend, dropout=dropout,
                              window=window)
    else:
        out = _default_attention(module, query, key, value, attention_mask, scaling, dropout, backend,
                                 kwargs.get("is_causal"), window)
    return out.transpose(1, 2).contiguous(), None


def plait_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` function ``"plait"`` (flex backend).

    Args:
        module: the HF attention module (read for ``is_causal`` when no ``plait_mask`` is given).
        query: ``[B, H, Nq, D]``; key, value: ``[B, Hkv, N, D]``.
        attention_mask: the 2-D padding mask ``[B, N]`` forwarded by plait's mask function, a prepared
            4-D mask, or None; ignored when ``plait_mask`` is given.
        scaling: softmax scale; dropout: attention dropout probability.
        **kwargs: ``plait_mask`` (:class:`MaskInfo`), ``plait_cp`` (a :class:`ContextParallelShard`) and HF's
            own kwargs.

    Returns:
        ``(output [B, Nq, H, Dv], None)`` (no attention weights).

    A layer's ``sliding_window`` kwarg (Gemma 3's, Mistral's local layers) limits its keys to that window
    (:func:`plait.attention.masks.build_mask_mod`).

    Raises:
        ValueError: on softcapping, attention sinks or position bias (unsupported), or inconsistent shapes.
    """
    return _forward("flex", module, query, key, value, attention_mask, scaling, dropout, kwargs)


def plait_sdpa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                                 scaling: float | None = None, dropout: float = 0.0,
                                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` function ``"plait_sdpa"``: as :func:`plait_attention_forward`, chunked SDPA."""
    return _forward("sdpa", module, query, key, value, attention_mask, scaling, dropout, kwargs)


def _padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function: Any = None, attention_mask: torch.Tensor | None = None,
                  **kwargs: Any) -> torch.Tensor | None:
    """``AttentionMaskInterface`` entry: hand the 2-D padding mask ``[B, kv_length]`` through (or None)."""
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def register_plait_attention() -> None:
    """Register ``"plait"`` and ``"plait_sdpa"`` with transformers' attention and mask registries.

    Idempotent. Needed before ``from_pretrained(..., attn_implementation="plait")`` or building a model
    from a config naming them; :func:`use_plait_attention` calls it.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    forwards = {"flex": plait_attention_forward, "sdpa": plait_sdpa_attention_forward}
    for backend, name in PLAIT_IMPLEMENTATIONS.items():
        AttentionInterface.register(name, forwards[backend])
        AttentionMaskInterface.register(name, _padding_mask)


def resolve_implementation(implementation: str, mask: str, packing: bool, cp: int, device_type: str) -> str:
    """``attention.implementation`` resolved: ``"auto"`` is ``"hf"`` when the LLM's own attention suffices
    (``mask = "causal"``, no packing, no context parallelism), else ``"plait"`` (flex) on CUDA and
    ``"plait_sdpa"`` elsewhere; any other value is returned as it is.

    Args:
        implementation: ``"auto"``, ``"hf"``, ``"plait"`` or ``"plait_sdpa"``; mask: ``attention.mask``;
        packing: ``data.packing``; cp: context-parallel degree; device_type: ``torch.device.type``.
    """
    if implementation != "auto":
        return implementation
    if mask == "causal" and cp == 1 and not packing:
        return "hf"
    return "plait" if device_type == "cuda" else "plait_sdpa"


def use_plait_attention(model_or_config: Any, backend: str = "flex") -> str:
    """Switch a HF model (in place, all its sub-models) or config to plait attention.

    Use it on the language model only: encoders keep their own attention. Then call
    ``model(..., plait_mask=MaskInfo.from_batch(batch, mode))``.

    Args:
        model_or_config: a ``transformers.PreTrainedModel`` or ``PreTrainedConfig``.
        backend: ``"flex"`` (registered as ``"plait"``) or ``"sdpa"`` (``"plait_sdpa"``).

    Returns:
        The attention implementation name now set.

    Raises:
        ValueError: on an unknown backend or an object that is neither a model nor a config.
    """
    from transformers import PreTrainedConfig, PreTrainedModel

    if backend not in PLAIT_IMPLEMENTATIONS:
        raise ValueError(f"use_plait_attention: backend must be one of {_BACKENDS}, got {backend!r}")
    register_plait_attention()
    name = PLAIT_IMPLEMENTATIONS[backend]
    if isinstance(model_or_config, PreTrainedModel):
        model_or_config.set_attn_implementation(name)
    elif isinstance(model_or_config, PreTrainedConfig):
        model_or_config._attn_implementation = name
    else:
        raise ValueError(f"use_plait_attention: expected a PreTrainedModel or PreTrainedConfig, "
                         f"got {type(model_or_config).__name__}")
    return name
