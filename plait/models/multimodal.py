"""The composite multimodal LLM: named modality encoders + a Hugging Face causal LM.

Placeholder injection follows Cornstarch (Jang et al., arXiv 2503.11367): the text carries one placeholder token
per encoder feature; placeholders are replaced by token 0 before the embedding lookup (no vocabulary
resize needed), then the projected features are scattered into those positions out of place.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from plait.models.encoder import ModalityEncoder
from plait.config.schema import LoraConfig
from plait.data.mrope import next_mrope_positions
from plait.models.deepstack import DEEPSTACK_KWARG, attach_deepstack_hooks, deepstack_extras
from plait.models.families.base import config_field
from plait.models.families.qwen2_5_vl import takes_mrope
from plait.models.file_modes import share_saved_files
from plait.models.hf import build_causal_lm, build_encoder, encoder_feature_size, llm_layout
from plait.models.lora import ADAPTER_DIR, base_state_dict, has_lora, inject_lora, load_adapter, lora_settings, save_adapter
from plait.models.projector import build_projector

__all__ = ["MultimodalModel", "PLAIT_CONFIG", "saved_video_settings"]

PLAIT_CONFIG = "plait_config.json"
PARTS = ("llm", "encoder", "projector")


class MultimodalModel(nn.Module):
    """Named modality encoders feeding a causal LM through placeholder tokens.

    Args:
        language_model: any Hugging Face causal LM (``AutoModelForCausalLM``).
        encoders: encoder branches by name, e.g. ``{"vision": ModalityEncoder(...)}``.
        placeholder_ids: token id of each branch's placeholder, same keys as ``encoders``.

    Raises:
        ValueError: when the keys of ``encoders`` and ``placeholder_ids`` differ, two branches share an id, or
            a projector's output width differs from the LLM's hidden size.
    """

    def __init__(
        self,
        language_model: PreTrainedModel,
        encoders: Mapping[str, ModalityEncoder],
        placeholder_ids: Mapping[str, int],
    ) -> None:
        super().__init__()
        if set(encoders) != set(placeholder_ids):
            raise ValueError(f"encoders {sorted(encoders)} and placeholder_ids {sorted(placeholder_ids)} differ")
        if len(set(placeholder_ids.values())) != len(placeholder_ids):
            raise ValueError(f"placeholder ids must be distinct, got {dict(placeholder_ids)}")
        hidden = language_model.get_input_embeddings().embedding_dim
        for name, enc in encoders.items():
            out = enc.projector.linear_1.out_features
            if out != hidden:
                raise ValueError(f"encoder {name!r}: projector gives {out} features, the LLM expects {hidden}")
        self.language_model = language_model
        self.encoders = nn.ModuleDict(dict(encoders))
        self.placeholder_ids = dict(placeholder_ids)
        self.deepstack_layers = max((len(config_field(enc.encoder.config, "deepstack_visual_indexes", ()) or ())
                                     for enc in encoders.values()), default=0)
        """LLM layers ``0 .. deepstack_layers - 1`` receive DeepStack features (:mod:`plait.models.deepstack`)."""
        self.deepstack_placeholders = {name: self.placeholder_ids[name] for name, enc in encoders.items()
                                       if config_field(enc.encoder.config, "deepstack_visual_indexes", ())}
        """The placeholder ids of the branches with DeepStack features (their tokens receive the additions)."""
        if self.deepstack_layers:
            attach_deepstack_hooks(language_model.get_submodule(llm_layout(language_model).layers),
                                   self.deepstack_layers)

    # ------------------------------------------------------------------ forward
    def embed(self, input_ids: torch.Tensor, modality_inputs: Mapping[str, Any] | None = None) -> torch.Tensor:
        """Token embeddings ``[B, N, hidden]`` with encoder features placed at the placeholder tokens.

        Args:
            input_ids: ``[B, N]`` token ids, placeholders included.
            modality_inputs: per encoder name, the inputs of :class:`ModalityEncoder` for the items of the
                batch in row-major placeholder order; a branch with no items may be absent.

        Raises:
            ValueError: when the number of placeholder tokens of a branch differs from its feature count.
        """
        return self.place_features(input_ids, self.encode_all(modality_inputs))

    def place_features(self, input_ids: torch.Tensor, features: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Token embeddings ``[B, N, hidden]`` of ``input_ids`` ``[B, N]`` with ``features[name]``
        ``[placeholders of name, hidden]`` scattered (out of place) into branch ``name``'s placeholder
        positions, row-major; placeholders are embedded as token 0 first. A branch with no placeholder in the
        batch may be absent from ``features``. Shared by :meth:`embed` and the first LLM pipeline stage.

        Raises:
            ValueError: when a branch has placeholders but no features, or a different number of features.
        """
        masks = {name: input_ids == pid for name, pid in self.placeholder_ids.items()}
        text_ids = input_ids
        for mask in masks.values():
            text_ids = text_ids.masked_fill(mask, 0)
        embeds = self.language_model.get_input_embeddings()(text_ids)
        for name, mask in masks.items():
            n_placeholders = int(mask.sum())
            if name not in features:
                if n_placeholders:
                    raise ValueError(f"{n_placeholders} {name!r} placeholder tokens but no {name!r} inputs")
                continue
            feats = features[name]
            if feats.shape[0] != n_placeholders:
                raise ValueError(
                    f"encoder {name!r} produced {feats.shape[0]} features but the batch has {n_placeholders} "
                    f"placeholder tokens"
                )
            embeds = embeds.masked_scatter(mask.unsqueeze(-1), feats[:, :embeds.shape[-1]].to(embeds.dtype))
        return embeds

    def deepstack(self, input_ids: torch.Tensor, features: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The LLM keyword argument carrying the batch's DeepStack additions (``{"plait_deepstack":
        DeepStackFeatures}``, dense ``[B, N, hidden]`` per receiving layer) of ``features`` (as
        :meth:`place_features` takes them; rows of ``(1 + k) * hidden`` values), or ``{}`` when there are none."""
        if not self.deepstack_layers:
            return {}
        hidden = self.language_model.get_input_embeddings().embedding_dim
        extras = deepstack_extras(input_ids, features, self.placeholder_ids, hidden)
        return {} if extras is None else {DEEPSTACK_KWARG: extras}

    def encode_all(self, modality_inputs: Mapping[str, Any] | None) -> dict[str, torch.Tensor]:
        """:meth:`encode` of every branch with inputs: ``{name: [features, width]}``.

        Raises:
            ValueError: for inputs of a branch the model does not have.
        """
        modality_inputs = modality_inputs or {}
        unknown = set(modality_inputs) - set(self.encoders)
        if unknown:
            raise ValueError(f"inputs for unknown encoder(s) {sorted(unknown)}; model has {sorted(self.encoders)}")
        return {name: self.encode(name, inputs) for name, inputs in modality_inputs.items()}

    def encode(self, name: str, inputs: Mapping[str, Any]) -> torch.Tensor:
        """Projected features ``[features, hidden]`` of branch ``name``; a fully frozen encoder runs under
        ``no_grad`` and keeps no activations."""
        branch: ModalityEncoder = self.encoders[name]  # type: ignore[assignment]
        encoder_trains = any(p.requires_grad for p in branch.encoder.parameters())
        with nullcontext() if encoder_trains else torch.no_grad():
            feats = branch.encoder_forward(inputs)
        return branch.projector(feats)

    def forward(
        self,
        input_ids: torch.Tensor,
        modality_inputs: Mapping[str, Any] | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        token_index: torch.Tensor | None = None,
        features: Mapping[str, torch.Tensor] | None = None,
        rope_position_ids: torch.Tensor | None = None,
        **llm_kwargs: Any,
    ) -> torch.Tensor:
        """Logits ``[B, N, vocab]`` (fp32 or the autocast dtype) for ``input_ids`` ``[B, N]``.

        ``attention_mask`` ``[B, N]`` (1 = token, 0 = padding) and ``position_ids`` ``[B, N]`` go to the LLM
        unchanged, as do extra keyword arguments (attention kwargs such as ``plait_mask``). With
        ``token_index`` (int64 ``[n]``) the LLM runs only on those tokens of every row (a context-parallel
        shard; ``position_ids`` must then be the shard's ``[B, n]`` global positions) and the logits are
        ``[B, n, vocab]``.

        ``features``: precomputed projected features per branch (``[placeholders of the branch, hidden]``,
        row-major, as :meth:`encode` returns them), placed instead of running the encoders; used when encoder
        outputs were computed in an earlier microbatch (deferral, ``plait.train.trainer``).

        ``rope_position_ids``: the batch's M-RoPE positions ``[3, B, N]`` (``Batch.rope_position_ids``, all ``N``
        tokens even with ``token_index``: :meth:`llm_positions` takes the shard's); an LLM that rotates with
        M-RoPE (Qwen2.5-VL's) gets them as its ``position_ids``, every other LLM gets ``position_ids``.

        Raises:
            ValueError: when both ``modality_inputs`` and ``features`` are given, and as :meth:`place_features`.
        """
        if features is not None:
            if modality_inputs:
                raise ValueError("pass modality_inputs or precomputed features, not both")
        else:
            features = self.encode_all(modality_inputs)
        embeds = self.place_features(input_ids, features)
        llm_kwargs.update(self.deepstack(input_ids, features))  # DeepStack: added after the first decoder layers
        if token_index is not None:
            embeds = embeds.index_select(1, token_index)
            if DEEPSTACK_KWARG in llm_kwargs:
                llm_kwargs[DEEPSTACK_KWARG] = llm_kwargs[DEEPSTACK_KWARG].select(lambda t: t.index_select(1, token_index))
        llm_kwargs.setdefault("use_cache", False)  # logits only: no KV cache (it would hold every layer's K/V)
        positions = self.llm_positions(position_ids, rope_position_ids, token_index, input_ids.shape[1])
        out = self.language_model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions,
                                  **llm_kwargs)
        return out.logits

    def llm_positions(self, position_ids: torch.Tensor | None, rope_position_ids: torch.Tensor | None,
                      token_index: torch.Tensor | None = None, tokens: int | None = None) -> torch.Tensor | None:
        """The ``position_ids`` the LLM rotates with: for an M-RoPE LLM (Qwen2.5-VL's,
        :func:`plait.models.families.qwen2_5_vl.takes_mrope`) given ``rope_position_ids`` ``[3, B, N]``, those (the
        ``token_index`` tokens of them when given: a context-parallel shard), else ``position_ids`` (``[B, N]`` or
        the shard's ``[B, n]``; an M-RoPE LLM spreads them over its three streams: text).

        ``tokens``: the rows' length; rows grown past the M-RoPE positions by decoding (tokens appended to
        left-padded prompts, as greedy decoding by forward passes does) put appended token ``k`` at the row's
        largest position ``+ 1 + k`` on all three streams (Qwen2.5-VL's ``rope_deltas`` rule; padding is 0)."""
        if rope_position_ids is None or not takes_mrope(self.language_model.config):
            return position_ids
        grown = 0 if tokens is None else tokens - rope_position_ids.shape[-1]
        if grown > 0:
            start = next_mrope_positions(rope_position_ids)[0]  # [B, 1]
            extra = start + torch.arange(grown, device=start.device)
            rope_position_ids = torch.cat([rope_position_ids, extra.expand(3, -1, -1)], dim=-1)
        if token_index is not None:
            return rope_position_ids.index_select(-1, token_index.to(rope_position_ids.device))
        return rope_position_ids

    # ------------------------------------------------------------------ freezing
    def part_parameters(self, part: str, encoder: str | None = None) -> list[nn.Parameter]:
        """Parameters of ``part`` (``"llm"``, ``"encoder"`` or ``"projector"``; the latter two of branch
        ``encoder``, or of every branch when None).

        Raises:
            ValueError: for an unknown part or branch.
        """
        if part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {part!r}")
        if part == "llm":
            return list(self.language_model.parameters())
        names = [encoder] if encoder is not None else list(self.encoders)
        params: list[nn.Parameter] = []
        for name in names:
            if name not in self.encoders:
                raise ValueError(f"unknown encoder {name!r}; model has {sorted(self.encoders)}")
            branch: ModalityEncoder = self.encoders[name]  # type: ignore[assignment]
            if part == "projector":
                params += list(branch.projector.parameters())
            else:
                params += [p for n, p in branch.encoder.named_parameters() if n not in branch.unreachable]
        return params

    def set_frozen(self, part: str, frozen: bool, encoder: str | None = None) -> None:
        """Freeze (``requires_grad=False``) or unfreeze a part; unreachable encoder parameters stay frozen."""
        for p in self.part_parameters(part, encoder):
            p.requires_grad_(not frozen)

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of every parameter with ``requires_grad``, in module order."""
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, directory: str | Path, merge_lora: bool = False,
                        video: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Write the composite: ``llm/`` and ``encoders/<name>/encoder/`` in Hugging Face format,
        ``encoders/<name>/projector.safetensors`` and ``plait_config.json`` (placeholder ids and each branch's
        settings, an audio branch's ``hop_length``/``sampling_rate`` too, which :meth:`from_pretrained` restores;
        ``video[name]``, an image branch's video settings ``{"placeholder", "fps", "max_frames", "audio"}``, as its
        ``"video"`` entry, which :func:`saved_video_settings` reads back for the processor).
        A part with LoRA adapters (:mod:`plait.models.lora`) is written as its plain Hugging Face base plus its
        adapter in ``peft``'s format in ``<part>/adapter/`` (``peft.PeftModel.from_pretrained(part,
        "<part>/adapter")`` loads it); with ``merge_lora`` the adapters are merged into the base weights instead (no
        adapter folder)."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        meta: dict[str, Any] = {"placeholder_ids": self.placeholder_ids, "encoders": {}, "lora": {}}
        _save_part(self.language_model, root / "llm", merge_lora, meta["lora"], "llm")
        for name, branch in self.encoders.items():
            sub = root / "encoders" / name
            _save_part(branch.encoder, sub / "encoder", merge_lora, meta["lora"], name)
            state = {k: v.detach().contiguous() for k, v in branch.projector.state_dict().items()}
            save_file(state, str(sub / "projector.safetensors"))
            meta["encoders"][name] = branch.settings() | {"encoder_dim": branch.encoder_dim} | _audio_window(branch)
            if video and name in video:
                meta["encoders"][name]["video"] = dict(video[name])
        (root / PLAIT_CONFIG).write_text(json.dumps(meta, indent=2))
        share_saved_files(root)  # safetensors writes 0600

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, attn_implementation: str = "sdpa", weights: bool = True
    ) -> "MultimodalModel":
        """Load a composite written by :meth:`save_pretrained` (all parameters trainable, except the base weights of
        a part saved with LoRA adapters: those are restored, trainable, on their frozen base). With
        ``weights=False`` only its configs are read (build under ``torch.device("meta")`` and materialise with
        :mod:`plait.models.init`, which loads the adapters too).

        Raises:
            FileNotFoundError: when ``directory`` has no ``plait_config.json``.
        """
        root = Path(directory)
        if not (root / PLAIT_CONFIG).is_file():
            raise FileNotFoundError(f"{root} is not a plait model directory (no {PLAIT_CONFIG})")
        meta = json.loads((root / PLAIT_CONFIG).read_text())
        llm = build_causal_lm(path=str(root / "llm"), attn_implementation=attn_implementation, weights=weights)
        lora = meta.get("lora", {})
        _restore_adapter(llm, root / "llm", lora.get("llm"), weights)
        hidden = llm.get_input_embeddings().embedding_dim
        encoders = {}
        for name, s in meta["encoders"].items():
            enc = build_encoder(s["modality"], path=str(root / "encoders" / name / "encoder"), weights=weights)
            _restore_adapter(enc, root / "encoders" / name / "encoder", lora.get(name), weights)
            projector = build_projector(s["projector"], encoder_feature_size(enc, s["downsample"]), hidden,
                                        float(getattr(enc.config, "layer_norm_eps", 1e-6)))
            if weights:
                projector.load_state_dict(load_file(str(root / "encoders" / name / "projector.safetensors")))
            window = {k: int(s[k]) for k in ("hop_length", "sampling_rate") if k in s}  # audio, when saved
            encoders[name] = ModalityEncoder(
                enc, projector, s["modality"], s["feature_layer"], s["select"], s["downsample"], **window
            )
        return cls(llm, encoders, meta["placeholder_ids"])


def saved_video_settings(directory: str | Path) -> dict[str, dict[str, Any]]:
    """Each image branch's video settings saved in ``directory``'s ``plait_config.json`` by
    :meth:`MultimodalModel.save_pretrained` (``{"placeholder", "fps", "max_frames", "audio"}`` by branch name; a branch
    saved without them, as by plait before they were saved, is absent).

    Raises:
        FileNotFoundError: when ``directory`` has no ``plait_config.json``.
    """
    path = Path(directory) / PLAIT_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a plait model directory (no {PLAIT_CONFIG})")
    meta = json.loads(path.read_text())
    return {name: dict(s["video"]) for name, s in meta["encoders"].items() if s.get("video")}


def _audio_window(branch: ModalityEncoder) -> dict[str, int]:
    """An audio branch's ``hop_length`` (samples per log-mel frame) and ``sampling_rate`` (Hz), saved so that a
    loaded branch counts features as its saved processor computes them; ``{}`` for image branches."""
    count = branch.feature_count
    if branch.modality != "audio" or not hasattr(count, "hop_length"):
        return {}
    return {"hop_length": int(count.hop_length), "sampling_rate": int(count.sampling_rate)}


def _save_part(module: nn.Module, directory: Path, merge: bool, lora: dict[str, Any], key: str) -> None:
    """Save one Hugging Face part: plain, or (adapted) its plain base and, unless ``merge``, its adapter and
    settings (``lora[key]``)."""
    if not has_lora(module):
        module.save_pretrained(directory)
        return
    module.save_pretrained(directory, state_dict=base_state_dict(module, merge))
    if not merge:
        lora[key] = lora_settings(module)
        save_adapter(module, directory / ADAPTER_DIR)


def _restore_adapter(module: nn.Module, directory: Path, settings: dict[str, Any] | None, weights: bool) -> None:
    """Re-inject a saved part's adapter (``settings`` from ``plait_config.json``) and, with ``weights``, load it."""
    if not settings:
        return
    cfg = LoraConfig(r=settings["r"], alpha=settings["alpha"], dropout=settings["dropout"],
                     target_modules=list(settings["target_modules"]))
    inject_lora(module, cfg, f"{directory}/{ADAPTER_DIR}")
    if weights:
        load_adapter(module, directory / ADAPTER_DIR)
