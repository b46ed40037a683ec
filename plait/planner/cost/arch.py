"""Architecture facts of a model described only by Hugging Face configs (no model built, no weights read).

``arch_from_config`` reads a decoder LLM (Llama, Mistral, Mixtral, Qwen2/3, Qwen3-MoE, Gemma/Gemma-2/3, Phi-3,
Phi, InternLM2-like dicts), a plain ViT or a Whisper-style audio encoder into a frozen ``DecoderArch`` /
``EncoderArch`` (other encoder families give their ``EncoderArch`` as data, from ``plait.models.families``);
``ProjectorArch`` is the projector between an encoder and the LLM. The classes hold the per-layer facts the
analytic cost model (``cost_model``) and the microbatch cost coefficients build on: parameters,
multiply-accumulates and FLOPs per token (``layer_flops``: the one per-layer FLOP formula), the pipeline
unit layout. ``units_from_configs`` gives a config-described model's pipeline units and
``model_param_count`` its parameter count. Notation as in ``cost_model``: ``H`` hidden size, ``I`` MLP
intermediate size, ``q = heads * head_dim``, ``kv = kv_heads * head_dim``, ``V`` vocabulary, ``E``
experts, ``k`` experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from plait.planner.cost.config_fields import config_field, config_model_type, config_pair, positive_field
from plait.planner.pipeline.graph import consistent_units
from plait.planner.types import LLM_MODULE, Unit

__all__ = [
    "Arch",
    "DecoderArch",
    "EncoderArch",
    "ProjectorArch",
    "arch_from_config",
    "model_param_count",
    "projector_arch",
    "split_model_configs",
    "units_from_configs",
]

# --------------------------------------------------------------------------------------------------
# Architectures


_PLAIN_MLPLLM_MODULES = frozenset({"phi"})
_FOUR_NORMLLM_MODULES = frozenset({"gemma2", "gemma3_text"})
_QK_NORMLLM_MODULES = frozenset({"qwen3", "qwen3_moe", "gemma3_text", "qwen3_vl_text", "qwen3_vl_moe_text",
                                 "qwen3_omni_moe_text"})


@dataclass(frozen=True)
class DecoderArch:
    """The shape facts of a decoder-only LLM that costs depend on (read from an HF config).

    Attributes:
        hidden, layers, heads, kv_heads, head_dim, intermediate, vocab: ``H``, layer count, query heads,
            key/value heads, per-head size, ``I``, ``V``.
        gated_mlp: SwiGLU/GeGLU MLP (gate, up, down: ``3 H I`` weights) rather than plain (``2 H I``).
        num_experts, experts_per_token, expert_intermediate: MoE (``E``, ``k``, per-expert ``I``); 0 = dense.
        qkv_bias, o_bias, mlp_bias, head_bias: bias vectors on those projections.
        norm_bias: LayerNorm (weight and bias) instead of RMSNorm (weight only).
        norms_per_layer: 2 (pre-attention, pre-MLP), 4 (Gemma-2/3 sandwich) or 1 (Phi parallel block).
        qk_norm_dim: size of the per-head q/k norms (Qwen3, Gemma-3), 0 for none.
        tied_embeddings: ``lm_head`` shares the embedding matrix.
        sliding_window: window of sliding-window layers (tokens), or None.
        sliding_layers: per layer, whether it uses the sliding window.
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool = True
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    head_bias: bool = False
    norm_bias: bool = False
    norms_per_layer: int = 2
    qk_norm_dim: int = 0
    tied_embeddings: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()

    @property
    def q_dim(self) -> int:
        """``q = heads * head_dim``."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """``kv = kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config: Any) -> "DecoderArch":
        """Read a decoder LLM config (``PretrainedConfig`` or dict with HF field names).

        Unknown ``model_type`` values are read as Llama-like (``attention_bias`` / ``mlp_bias`` fields).

        Raises:
            ValueError: on a missing field, or a MoE layout not modelled (shared experts, dense layers
                mixed with sparse ones).
        """
        mtype = config_model_type(config)
        hidden, heads = positive_field(config, "hidden_size"), positive_field(config, "num_attention_heads")
        layers = positive_field(config, "num_hidden_layers")
        window, sliding = _sliding_layout(config, layers)
        qkv_bias, o_bias, mlp_bias = _decoder_biases(config, mtype)
        head_dim = positive_field(config, "head_dim", hidden // heads)
        return cls(
            hidden=hidden, layers=layers, heads=heads,
            kv_heads=positive_field(config, "num_key_value_heads", heads), head_dim=head_dim,
            intermediate=positive_field(config, "intermediate_size"), vocab=positive_field(config, "vocab_size"),
            gated_mlp=mtype not in _PLAIN_MLPLLM_MODULES, **_moe_fields(config),
            qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias, head_bias=mtype == "phi",
            norm_bias=mtype == "phi", norms_per_layer=4 if mtype in _FOUR_NORMLLM_MODULES else (1 if mtype == "phi" else 2),
            qk_norm_dim=head_dim if mtype in _QK_NORMLLM_MODULES else 0,
            tied_embeddings=bool(config_field(config, "tie_word_embeddings", False)),
            sliding_window=window, sliding_layers=sliding,
        )

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` uses the sliding window."""
        return self.sliding_window is not None and bool(self.sliding_layers) and self.sliding_layers[layer]

    def layout(self) -> list[tuple[str, str, int]]:
        """Pipeline units ``(name suffix, kind, layer index or -1)``: embed_tokens, layers.i, norm, lm_head."""
        return ([("embed_tokens", "embed", -1)] + [(f"layers.{i}", "layer", i) for i in range(self.layers)]
                + [("norm", "norm", -1), ("lm_head", "head", -1)])

    def layer_params(self) -> int:
        """Parameters of one decoder layer.

        ``H (q + 2 kv) + q H`` attention weights (+ ``q + 2 kv`` / ``H`` biases), ``2 qk_norm_dim`` q/k
        norms, ``norms_per_layer * H`` norm weights (x2 with LayerNorm bias), and the MLP: gated
        ``3 H I`` (+ ``2 I + H`` biases), plain ``2 H I`` (+ ``I + H``), MoE ``E (3 H I_e) + H E`` (router).
        """
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        attn = h * (q + 2 * kv) + q * h + self.qkv_bias * (q + 2 * kv) + self.o_bias * h
        norms = self.norms_per_layer * h * (2 if self.norm_bias else 1) + 2 * self.qk_norm_dim
        if self.num_experts:
            mlp = self.num_experts * 3 * h * self.expert_intermediate + h * self.num_experts
        elif self.gated_mlp:
            mlp = 3 * h * self.intermediate + self.mlp_bias * (2 * self.intermediate + h)
        else:
            mlp = 2 * h * self.intermediate + self.mlp_bias * (self.intermediate + h)
        return attn + norms + mlp

    def layer_macs_per_token(self) -> int:
        """Weight multiply-accumulates per token of one layer: ``H (q + 2 kv) + q H`` + MLP (gated
        ``3 H I``, plain ``2 H I``, MoE ``H E + k 3 H I_e`` for the router and the ``k`` routed experts)."""
        h = self.hidden
        if self.num_experts:
            mlp = h * self.num_experts + self.experts_per_token * 3 * h * self.expert_intermediate
        else:
            mlp = (3 if self.gated_mlp else 2) * h * self.intermediate
        return h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + mlp

    def layer_flops(self) -> tuple[int, int]:
        """(forward FLOPs per token, forward FLOPs per attended (query, key) pair) of one layer:
        ``2 layer_macs_per_token`` and ``4 q`` (``Q K^T`` and ``P V``, 2 FLOPs per multiply-accumulate)."""
        return 2 * self.layer_macs_per_token(), 4 * self.q_dim


def _decoder_biases(config: Any, mtype: str) -> tuple[bool, bool, bool]:
    """(q/k/v bias, output-projection bias, MLP bias) of a decoder family."""
    if mtype == "phi":
        return True, True, True
    if mtype == "internlm2":
        bias = bool(config_field(config, "bias", True))
        return bias, bias, False
    mlp_bias = bool(config_field(config, "mlp_bias", False))
    if mtype in ("qwen2", "qwen2_moe"):
        return True, False, mlp_bias
    attention_bias = bool(config_field(config, "attention_bias", False))
    return attention_bias, attention_bias, mlp_bias


def _moe_fields(config: Any) -> dict[str, int]:
    """MoE fields of a decoder config (Mixtral: ``num_local_experts``; Qwen-MoE: ``num_experts``).

    Raises:
        ValueError: on shared experts or sparse layers mixed with dense ones (not modelled).
    """
    experts = int(config_field(config, "num_local_experts", 0) or config_field(config, "num_experts", 0))
    if not experts:
        return {}
    if config_field(config, "shared_expert_intermediate_size", 0):
        raise ValueError("MoE with shared experts (shared_expert_intermediate_size) is not modelled")
    if config_field(config, "mlp_only_layers", []) or int(config_field(config, "decoder_sparse_step", 1)) != 1:
        raise ValueError("MoE configs mixing dense and sparse layers (mlp_only_layers / decoder_sparse_step) "
                         "are not modelled")
    return {
        "num_experts": experts,
        "experts_per_token": positive_field(config, "num_experts_per_tok"),
        "expert_intermediate": positive_field(config, "moe_intermediate_size",
                                              config_field(config, "intermediate_size")),
    }


def _sliding_layout(config: Any, layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """Sliding window and per-layer flags: from ``layer_types`` when present, else every layer uses
    ``sliding_window`` unless ``use_sliding_window`` is False."""
    window = config_field(config, "sliding_window", None)
    layer_types = config_field(config, "layer_types", None)
    if window is None:
        return None, ()
    if layer_types is not None:
        if len(layer_types) != layers:
            raise ValueError(f"config layer_types has {len(layer_types)} entries for {layers} layers")
        return int(window), tuple(t == "sliding_attention" for t in layer_types)
    if config_field(config, "use_sliding_window", True) is False:
        return None, ()
    return int(window), (True,) * layers


@dataclass(frozen=True)
class EncoderArch:
    """The shape facts of a ViT-style vision or Whisper-style audio encoder (given by the encoder's family, or read
    from a plain ViT / Whisper config by ``from_config``).

    Attributes:
        modality: ``"vision"`` or ``"audio"``.
        hidden, layers, heads, head_dim, intermediate: ``H``, layer count, heads, per-head size, ``I``.
        gated_mlp: gated MLP (``3 H I``) instead of plain fc1/fc2 (``2 H I``).
        qkv_bias: bias on (q, k, v) each; o_bias, mlp_bias: bias on output projection / MLP.
        norm_bias: LayerNorm (weight and bias) in the layers, else RMSNorm.
        qk_norm_dim: size of each q/k norm (InternVL: ``H``), 0 for none.
        layer_scale: two learned per-channel scales per layer (InternVL ``lambda_1/2``).
        num_channels, patch: image channels and patch size (vision).
        prefix_tokens: tokens before the patches (CLS), vision.
        positions: rows of the learned position table.
        patch_bias, pre_norm: patch-embedding bias; LayerNorm right after the embeddings (CLIP).
        num_mel_bins, conv_kernel: audio front-end (two convolutions, the second with stride 2).
        post_norm: final LayerNorm (its own pipeline unit).
        output_pool: average pooling of the encoder output before the post-norm (Qwen2-Audio: 2).
        item_len: native tokens per item (image: patches + prefix; audio clip: output frames).
        resized_positions: SigLIP2 NaFlex resizes its position grid per image (a matmul: positions MACs/token).
        merger: ``(in, out)`` widths of a patch merger in the post-norm slot (Qwen2.5-VL: RMSNorm ``H``, then
            Linear(in, in) -> GELU -> Linear(in, out) on ``in = merge^2 H``); ``(0, 0)``: a plain LayerNorm.
        window, full_layers: patches per attention window of the layers not in ``full_layers`` (Qwen2.5-VL's
            window attention); 0: every layer attends over the whole item.
        deepstack: ``k``, the LLM layers ``0 .. k-1`` that also receive this encoder's features (DeepStack, Meng et
            al., arXiv 2406.04334; Qwen3-VL): ``k`` more mergers of the merger's shape in the post-norm slot, and
            ``(1 + k)`` features of the LLM width per output token (``planner.pipeline.graph.feature_receivers``).
    """

    modality: str
    hidden: int
    layers: int
    heads: int
    head_dim: int
    intermediate: int
    gated_mlp: bool = False
    qkv_bias: tuple[bool, bool, bool] = (True, True, True)
    o_bias: bool = True
    mlp_bias: bool = True
    norm_bias: bool = True
    qk_norm_dim: int = 0
    layer_scale: bool = False
    num_channels: int = 3
    patch: tuple[int, int] = (1, 1)
    prefix_tokens: int = 0
    positions: int = 0
    patch_bias: bool = True
    pre_norm: bool = False
    num_mel_bins: int = 0
    conv_kernel: int = 3
    post_norm: bool = True
    output_pool: int = 1
    item_len: int = 1
    resized_positions: bool = False
    merger: tuple[int, int] = (0, 0)
    window: int = 0
    full_layers: tuple[int, ...] = ()
    deepstack: int = 0

    @property
    def q_dim(self) -> int:
        """``q = heads * head_dim``."""
        return self.heads * self.head_dim

    def norm_macs_per_token(self) -> int:
        """Multiply-accumulates of the post-norm unit per output token: a merger's ``in^2 + in out`` (``1 + k``
        times with ``k`` DeepStack mergers), else 0."""
        return (1 + self.deepstack) * self.merger[0] * (self.merger[0] + self.merger[1])

    @classmethod
    def from_config(cls, config: Any) -> "EncoderArch":
        """Read an encoder config by its fields alone, with no family knowledge: a Whisper-style audio encoder
        (a ``num_mel_bins`` field) or else a plain ViT (CLS token, biases as ``qkv_bias`` says, default on,
        LayerNorm, post-norm). A family's own facts (SigLIP's missing CLS token, CLIP's pre-norm, ...) are given
        as an ``EncoderArch`` built from ``plait.models.families`` (``EncoderFamily.arch_fields``).

        Raises:
            ValueError: on a missing field or a composite config (pass its ``vision_config``).
        """
        if config_field(config, "num_mel_bins", None) is not None:
            return _audio_arch(config)
        return _vision_arch(config)

    def layout(self) -> list[tuple[str, str, int]]:
        """Pipeline units ``(name suffix, kind, layer index or -1)``: embeddings, layers.i, post_norm."""
        units = [("embeddings", "embed", -1)] + [(f"layers.{i}", "layer", i) for i in range(self.layers)]
        return units + ([("post_norm", "norm", -1)] if self.post_norm else [])

    def norm_params(self) -> int:
        """Parameters of the final LayerNorm: ``2 H``; of a merger: its norm (``H`` RMSNorm, ``2 H`` LayerNorm with
        ``norm_bias``) + ``in^2 + in + in out + out``, plus ``k`` DeepStack mergers of ``2 in + in^2 + in + in out +
        out`` (a LayerNorm over the merged ``in``)."""
        m_in, m_out = self.merger
        if m_in:
            linear = m_in * m_in + m_in + m_in * m_out + m_out
            norm = (2 if self.norm_bias else 1) * self.hidden
            return norm + linear + self.deepstack * (2 * m_in + linear)
        return 2 * self.hidden

    def embed_params(self) -> int:
        """Embedding parameters. Vision: ``C p_h p_w H`` patch weights (+ ``H`` bias), ``prefix H`` CLS,
        ``positions H`` table, ``2 H`` pre-norm (``H``: an RMSNorm, Pixtral's ``ln_pre``). Audio: conv1
        ``mel k H + H``, conv2 ``H k H + H``, ``positions H`` (Whisper's fixed sinusoidal table is a parameter
        too)."""
        h = self.hidden
        if self.modality == "audio":
            conv = self.num_mel_bins * self.conv_kernel * h + h + h * self.conv_kernel * h + h
            return conv + self.positions * h
        patch = self.num_channels * self.patch[0] * self.patch[1] * h + self.patch_bias * h
        return patch + (self.prefix_tokens + self.positions) * h + self.pre_norm * (2 if self.norm_bias else 1) * h

    def layer_params(self) -> int:
        """Parameters of one layer: ``4 H q``-style attention (``H 3q + q H`` + biases), ``2 qk_norm_dim``,
        two norms (``2 H`` each with bias, ``H`` without), ``2 H`` layer scale, MLP ``2 H I + I + H``
        (plain) or ``3 H I`` (gated) + biases."""
        h, q, inter = self.hidden, self.q_dim, self.intermediate
        attn = 3 * h * q + q * h + sum(self.qkv_bias) * q + self.o_bias * h + 2 * self.qk_norm_dim
        norms = 2 * h * (2 if self.norm_bias else 1) + (2 * h if self.layer_scale else 0)
        if self.gated_mlp:
            mlp = 3 * h * inter + self.mlp_bias * (2 * inter + h)
        else:
            mlp = 2 * h * inter + self.mlp_bias * (inter + h)
        return attn + norms + mlp

    def layer_macs_per_token(self) -> int:
        """Weight multiply-accumulates per token of one layer: ``3 H q + q H + (3 or 2) H I``."""
        return 4 * self.hidden * self.q_dim + (3 if self.gated_mlp else 2) * self.hidden * self.intermediate

    def layer_flops(self) -> tuple[int, int]:
        """(forward FLOPs per token, forward FLOPs per attended pair) of one layer, as ``DecoderArch``."""
        return 2 * self.layer_macs_per_token(), 4 * self.q_dim

    def embed_macs_per_token(self) -> int:
        """Embedding multiply-accumulates per output token. Vision: ``C p_h p_w H`` per patch token
        (prefix tokens are looked up). Audio: conv1 runs on 2 input frames per output frame
        (``2 mel k H``), conv2 (stride 2) ``H k H``."""
        h = self.hidden
        if self.modality == "audio":
            return 2 * self.num_mel_bins * self.conv_kernel * h + h * self.conv_kernel * h
        return self.num_channels * self.patch[0] * self.patch[1] * h + self.resized_positions * self.positions * h


def _audio_arch(config: Any) -> EncoderArch:
    """A Whisper-style encoder: conv front-end, biases except on k, LayerNorm, post-norm, no output pooling."""
    hidden, heads = positive_field(config, "d_model"), positive_field(config, "encoder_attention_heads")
    positions = positive_field(config, "max_source_positions")
    return EncoderArch(
        modality="audio", hidden=hidden, layers=positive_field(config, "encoder_layers"), heads=heads,
        head_dim=hidden // heads, intermediate=positive_field(config, "encoder_ffn_dim"),
        qkv_bias=(True, False, True), num_mel_bins=positive_field(config, "num_mel_bins"),
        positions=positions, item_len=positions,
    )


def _vision_arch(config: Any) -> EncoderArch:
    """A plain ViT: a CLS token before ``(image_size / patch_size)^2`` patches, a learned position table."""
    if config_field(config, "vision_config", None) is not None:
        raise ValueError(f"config {config_model_type(config)!r} is composite: pass its vision_config")
    hidden, heads = positive_field(config, "hidden_size"), positive_field(config, "num_attention_heads")
    patch = config_pair(config_field(config, "patch_size"), "patch_size")
    image = config_pair(config_field(config, "image_size"), "image_size")
    patches = (image[0] // patch[0]) * (image[1] // patch[1])
    bias = bool(config_field(config, "qkv_bias", True))
    return EncoderArch(
        modality="vision", hidden=hidden, layers=positive_field(config, "num_hidden_layers"), heads=heads,
        head_dim=hidden // heads, intermediate=positive_field(config, "intermediate_size"),
        qkv_bias=(bias, bias, bias), num_channels=positive_field(config, "num_channels", 3), patch=patch,
        prefix_tokens=1, positions=patches + 1, item_len=patches + 1,
    )


@dataclass(frozen=True)
class ProjectorArch:
    """The projector between an encoder and the LLM (``plait.models.projector``).

    Attributes:
        kind: ``"mlp"`` (Linear(in, out) -> GELU -> Linear(out, out), LLaVA-1.5), ``"linear"`` or ``"gemma3"``
            (RMSNorm(in) -> Linear(in, out) without bias, Gemma 3).
        in_dim, out_dim: encoder feature size and LLM hidden size.

    Raises:
        ValueError: on another kind or non-positive sizes.
    """

    kind: str
    in_dim: int
    out_dim: int

    def __post_init__(self) -> None:
        if self.kind not in ("mlp", "linear", "gemma3"):
            raise ValueError(f"projector kind must be 'mlp', 'linear' or 'gemma3', got {self.kind!r}")
        if self.in_dim <= 0 or self.out_dim <= 0:
            raise ValueError(f"projector sizes must be > 0, got {self.in_dim} -> {self.out_dim}")

    def params(self) -> int:
        """``in out + out`` (+ ``out out + out`` for mlp; ``in out + in`` for gemma3: no bias, the norm's weight)."""
        if self.kind == "gemma3":
            return self.in_dim * self.out_dim + self.in_dim
        first = self.in_dim * self.out_dim + self.out_dim
        return first + (self.out_dim * self.out_dim + self.out_dim if self.kind == "mlp" else 0)

    def macs_per_token(self) -> int:
        """``in out`` (+ ``out out`` for mlp)."""
        return self.in_dim * self.out_dim + (self.out_dim * self.out_dim if self.kind == "mlp" else 0)


Arch = Union[DecoderArch, EncoderArch, ProjectorArch]


def arch_from_config(config: Any) -> DecoderArch | EncoderArch:
    """Decoder or encoder architecture of an HF config (object or dict); an ``EncoderArch`` /
    ``DecoderArch`` passes through. A ``num_mel_bins`` or ``patch_size`` field: an encoder read by the generic
    ``EncoderArch.from_config``; otherwise a decoder LLM.

    Raises:
        ValueError: on missing fields (named) or unsupported layouts.
    """
    if isinstance(config, (DecoderArch, EncoderArch)):
        return config
    if any(config_field(config, name, None) is not None for name in ("num_mel_bins", "patch_size")):
        return EncoderArch.from_config(config)
    if config_field(config, "vision_config", None) is not None or config_field(config, "text_config", None) is not None:
        raise ValueError(f"config {config_model_type(config)!r} is composite: pass its text_config / vision_config")
    return DecoderArch.from_config(config)


# --------------------------------------------------------------------------------------------------
# Model configs -> architectures, units, parameter counts


def split_model_configs(model_configs: Mapping[str, Any]) -> tuple[dict[str, Arch], dict[str, Any]]:
    """(module -> architecture, encoder -> projector config). Keys: encoder names, ``"llm"`` and
    ``"<encoder>.projector"``.

    Raises:
        ValueError: on a projector key without its encoder, or an ``"llm"`` config that is an encoder.
    """
    archs: dict[str, Arch] = {}
    projectors: dict[str, Any] = {}
    for key, config in model_configs.items():
        if key.endswith(".projector"):
            projectors[key.removesuffix(".projector")] = config
        else:
            archs[key] = arch_from_config(config)
    for encoder in projectors:
        if encoder not in archs or encoder == LLM_MODULE:
            raise ValueError(f"projector config {encoder + '.projector'!r} has no encoder config {encoder!r}")
    if LLM_MODULE in archs and not isinstance(archs[LLM_MODULE], DecoderArch):
        raise ValueError("model_configs['llm'] must be a decoder LLM config")
    for key, arch in archs.items():
        if key != LLM_MODULE and not isinstance(arch, EncoderArch):
            raise ValueError(f"model_configs[{key!r}] must be an encoder config (the LLM goes under 'llm')")
    return archs, projectors


def projector_arch(encoder: str, archs: Mapping[str, Arch], projectors: Mapping[str, Any]) -> ProjectorArch:
    """Projector of ``encoder``: from ``model_configs["<encoder>.projector"]`` (a ``ProjectorArch`` or a
    dict with ``kind``, ``in_dim``, ``out_dim``), defaulting to an ``mlp`` from the encoder's hidden size to
    the LLM's.

    Raises:
        ValueError: when a size cannot be determined.
    """
    given = projectors.get(encoder, {})
    if isinstance(given, ProjectorArch):
        return given
    if not isinstance(given, Mapping):
        raise ValueError(f"projector config of {encoder!r} must be a ProjectorArch or a dict")
    unknown = set(given) - {"kind", "in_dim", "out_dim"}
    if unknown:
        raise ValueError(f"projector config of {encoder!r}: unknown field(s) {sorted(unknown)}")
    out_dim = given.get("out_dim") or (archs[LLM_MODULE].hidden if LLM_MODULE in archs else None)
    if out_dim is None:
        raise ValueError(f"projector of {encoder!r} needs out_dim or an 'llm' config")
    encoder_arch = archs[encoder]
    features = (encoder_arch.merger[1] if isinstance(encoder_arch, EncoderArch) else 0) or encoder_arch.hidden
    return ProjectorArch(given.get("kind", "mlp"), int(given.get("in_dim") or features), int(out_dim))


def units_from_configs(model_configs: Mapping[str, Any], frozen: Mapping[str, bool] | None = None) -> tuple[Unit, ...]:
    """The pipeline units of a model described only by configs, in execution order.

    Each encoder branch (keys other than ``"llm"``, in mapping order) gives ``encoders.<m>.embeddings``,
    ``encoders.<m>.layers.<i>``, ``encoders.<m>.post_norm`` (if the encoder has one) and
    ``encoders.<m>.projector``; then the LLM gives ``llm.embed_tokens``, ``llm.layers.<i>``, ``llm.norm``,
    ``llm.lm_head``.

    Args:
        model_configs: ``{"vision": cfg, "llm": cfg, "vision.projector": {...}}`` (projector optional).
        frozen: ``{"vision": True, "vision.projector": False, "llm": True}``; a missing key means trainable.

    Flags: ``trainable`` = the unit's part is not frozen;
    ``needs_input_grad`` by the unit-graph rule (``graph.consistent_units``): some unit upstream trains. So
    encoder embeddings never need an input gradient (pixels, mel frames); the LLM's token embedding needs one
    when an encoder branch trains, since the projected features are merged there.

    Raises:
        ValueError: on an unknown ``frozen`` key or non-bool value, or bad configs.
    """
    archs, _ = split_model_configs(model_configs)
    frozen = dict(frozen or {})
    known = set(archs) | {f"{m}.projector" for m in archs if m != LLM_MODULE}
    for key, value in frozen.items():
        if key not in known:
            raise ValueError(f"frozen key {key!r} is not a model part; known: {sorted(known)}")
        if not isinstance(value, bool):
            raise ValueError(f"frozen[{key!r}] must be a bool, got {value!r}")
    units: list[Unit] = []
    for module in sorted(archs, key=lambda m: m == LLM_MODULE):  # encoders in mapping order, then the LLM
        arch, trains = archs[module], not frozen.get(module, False)
        prefix = LLM_MODULE if module == LLM_MODULE else f"encoders.{module}"
        joined = isinstance(arch, EncoderArch) and arch.deepstack > 0  # the tower is one stage (Unit.joined)
        units += [Unit(f"{prefix}.{suffix}", module, kind, trains, False, joined=joined and kind != "embed")
                  for suffix, kind, _ in arch.layout()]
        if module != LLM_MODULE:
            trains_projector = not frozen.get(f"{module}.projector", False)
            units.append(Unit(f"encoders.{module}.projector", module, "projector", trains_projector, False))
    return consistent_units(units, require_llm=False)


def model_param_count(config: Any) -> int:
    """Parameters of the HF model a config describes (decoder: ``*ForCausalLM``, counting a tied
    ``lm_head`` once; encoder: the vision/audio tower without pooling heads), from the same formulas as
    the units.

    Raises:
        ValueError: as ``arch_from_config``.
    """
    arch = arch_from_config(config)
    if isinstance(arch, EncoderArch):
        return arch.embed_params() + arch.layers * arch.layer_params() + (arch.norm_params() if arch.post_norm else 0)
    embed = arch.vocab * arch.hidden
    head = 0 if arch.tied_embeddings else embed + arch.head_bias * arch.vocab
    return embed + arch.layers * arch.layer_params() + arch.hidden * (2 if arch.norm_bias else 1) + head
