"""Generation: greedy answers of a trained :class:`~plait.models.multimodal.MultimodalModel` to conversations with
images and audio.

:func:`greedy_generate` is the one greedy decoding of plait: validation by generation in the trainer
(``plait.train.trainer.Trainer.generate``) and inference (:class:`Generator`, ``plait generate``) both run it, so
an answer given at inference is the answer validation scored. It embeds a left-padded batch of prompts (encoder
features placed at their placeholders, :meth:`MultimodalModel.embed`) and runs the Hugging Face LLM's own
``generate`` on ``inputs_embeds`` (KV cache; positions derived from the attention mask, so left padding is
harmless; an M-RoPE LLM gets the prompt's ``Batch.rope_position_ids`` and continues them, Qwen2.5-VL's rule; Gemma
3's LLM continues from a cache its images filled attending to each other both ways,
:func:`plait.models.gemma3.prefill_items`),
greedy, until every row emits a stop token (:func:`stop_token_ids`) or ``max_new_tokens``.

:class:`Generator` loads what ``plait train`` writes to ``<run_dir>/final`` (the model, ``tokenizer/``,
``processors/<encoder>/``) in eval mode with every parameter frozen, and turns :class:`Prompt` objects (or
records of plait's data format, processed by the caller) into text.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.config.schema import ModelConfig
from plait.data.chat_template import render_with_assistant_mask
from plait.data.collate import Batch, collate
from plait.data.mrope import next_mrope_positions
from plait.data.omni_positions import THINKERS
from plait.data.processing import MultimodalProcessor, ProcessedSample
from plait.data.sources import RawSample, path_note
from plait.models.device import resolve_device
from plait.models.gemma3 import attends_items, prefill_items
from plait.models.hf_io_omni import THINKERS as HF_THINKERS
from plait.models.multimodal import PLAIT_CONFIG, MultimodalModel
from plait.models.registry import build_processor, load_tokenizer

__all__ = ["Prompt", "Generator", "stop_token_ids", "greedy_token_ids", "greedy_generate", "exact_match",
           "is_empty_answer", "inference_processor", "check_decoding", "save_final",
           "with_stop_tokens", "ITEM_WRAPPERS", "item_prompt_text"]


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """Token ids that end a generated answer, sorted: the tokenizer's EOS, the token that closes an assistant turn
    in its chat template (the first special token of the trained span of a rendered one-turn chat,
    :func:`plait.data.chat_template.render_with_assistant_mask`, unknown-token id aside: ChatML's ``<|im_end|>`` for
    the demo tokenizer, Llama-3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``), and the ``eos_token_id`` (an id or a list) of
    ``generation_config`` (the LLM's ``GenerationConfig``, optional) where the tokenizer marks that id as a
    special token: a config built from defaults (``LlamaConfig``'s ``eos_token_id = 2``) may name an ordinary
    token of another tokenizer, which must not end answers.

    Raises:
        SampleError: when the chat template refuses a one-turn user/assistant conversation.
    """
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    ids, mask = render_with_assistant_mask(tokenizer, chat)
    eos = tokenizer.eos_token_id
    unk = tokenizer.unk_token_id if tokenizer.unk_token_id != eos else None  # GPT-2-style tokenizers: unk == eos
    added = {i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if tok.special}
    special = (set(tokenizer.all_special_ids) | added) - {unk}  # a word-level vocabulary may not know "y"
    turn_end = next((t for t, m in zip(ids, mask) if m and t in special), None)
    found = {eos, turn_end}
    config_eos = getattr(generation_config, "eos_token_id", None)
    for t in config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]:
        if isinstance(t, int) and t in special:
            found.add(t)
    return sorted(t for t in found if isinstance(t, int) and t != unk)


def with_stop_tokens(generation_config: Any, tokenizer: Any) -> Any:
    """A copy of an LLM's ``GenerationConfig`` whose ``eos_token_id`` lists :func:`stop_token_ids` (the chat
    template's end of turn too) and whose ``pad_token_id`` is the tokenizer's when unset: saved as
    ``generation_config.json`` (``final/llm/``, ``plait export``), transformers' ``generate`` (and servers reading
    that file) stop where plait's generation stops instead of running on through the end-of-turn token.

    Raises:
        SampleError: as :func:`stop_token_ids`.
    """
    out = copy.deepcopy(generation_config)
    out.eos_token_id = stop_token_ids(tokenizer, generation_config)
    if out.pad_token_id is None and tokenizer.pad_token_id is not None:
        out.pad_token_id = int(tokenizer.pad_token_id)
    return out


def check_decoding(max_new_tokens: int, stop_ids: Sequence[int]) -> None:
    """The arguments every greedy decoding needs (this module's and the pipeline's in ``plait.train.evaluation``).

    Raises:
        ValueError: when ``max_new_tokens`` < 1 or ``stop_ids`` is empty (no stop token).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not stop_ids:
        raise ValueError("no stop token: generation needs at least one (the tokenizer's EOS)")


@torch.no_grad()
def greedy_token_ids(model: MultimodalModel, batch: Batch, stop_ids: Sequence[int], max_new_tokens: int, pad_id: int,
                     autocast: Callable[[], AbstractContextManager[Any]] = nullcontext) -> torch.Tensor:
    """The new tokens ``[B, T]`` (``T <= max_new_tokens``) of greedy decoding from a batch of prompts: a row ends
    with the first of ``stop_ids`` it emits (kept) and is ``pad_id`` after it; decoding stops when every row has
    ended or after ``max_new_tokens``.

    Args:
        model: the composite model (its mode is left as it is; :class:`Generator` holds it in eval mode).
        batch: prompts collated with ``padding_side="left"`` (``input_ids``/``attention_mask`` ``[B, N]``), on the
            model's device.
        stop_ids: :func:`stop_token_ids`.
        max_new_tokens: at most this many new tokens per row.
        pad_id: the id that pads rows that ended early.
        autocast: a context factory around the forward passes (``torch.autocast`` for bf16, or none).

    Raises:
        ValueError: when ``max_new_tokens`` < 1 or there is no stop token, or (Gemma 3) a prompt ends with an image
            token, or (a DeepStack or item-attention family) a prompt whose last token is below its largest M-RoPE
            position.
    """
    check_decoding(max_new_tokens, stop_ids)
    positions, following = _mrope_prompt_positions(model, batch)
    with autocast():
        features = model.encode_all(batch.modality_inputs)
        embeds = model.place_features(batch.input_ids, features)
        cache = {}
        deepstack = model.deepstack(batch.input_ids, features)
        if deepstack:  # DeepStack: the prompt but its last token fills the cache with the additions
            cache = {"cache": _prefill_deepstack(model, embeds, batch, positions, deepstack)}
        if attends_items(model.language_model.config) and bool((batch.item_ids >= 0).any()):
            cache = {"cache": prefill_items(model.language_model, embeds, batch)}  # images both ways
        mask, first = batch.attention_mask, None
        if following is not None:  # the last prompt token below the largest position: decode its first token here
            if cache:
                raise ValueError("M-RoPE generation needs each prompt to end with text after its images/videos (its "
                                 "last token at its largest position) for this family; end the prompt with the chat "
                                 "template's generation prompt")
            out = model.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                       use_cache=True)
            first = out.logits[:, -1].argmax(-1)  # [B] greedy, as generate's first step
            if max_new_tokens == 1 or all(int(t) in stop_ids for t in first):
                return first[:, None]
            embeds = torch.cat([embeds, model.language_model.get_input_embeddings()(first)[:, None]], dim=1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            positions = torch.cat([positions, following.to(positions)], dim=-1)  # at max + 1; generate goes on +1
            cache, max_new_tokens = {"cache": out.cache}, max_new_tokens - 1
        new = model.language_model.generate(
            inputs_embeds=embeds,
            attention_mask=mask,
            **({} if positions is None else {"position_ids": positions}),
            **cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(stop_ids),
            pad_token_id=pad_id,
        )
        return new if first is None else _after_first(first, new, stop_ids, pad_id)


def _after_first(first: torch.Tensor, new: torch.Tensor, stop_ids: Sequence[int], pad_id: int) -> torch.Tensor:
    """``first`` ``[B]`` (the token decoded before ``generate``) then ``new`` ``[B, T]``; a row whose first token is a
    stop token is ``pad_id`` after it, as ``generate`` pads a row that ended."""
    ended = torch.tensor([int(t) in stop_ids for t in first], device=new.device)[:, None]
    return torch.cat([first[:, None].to(new), new.masked_fill(ended, pad_id)], dim=1)


def _prefill_deepstack(model: MultimodalModel, embeds: torch.Tensor, batch: Batch, positions: torch.Tensor | None,
                       deepstack: dict[str, Any]) -> Any:
    """The LLM's KV cache of all but the last token of left-padded prompts ``embeds`` ``[B, N, hidden]`` with their
    DeepStack additions (:mod:`plait.models.deepstack`, as transformers' Qwen3-VL adds them in its prompt pass);
    ``generate`` continues from it (the last token and every decoded one are text: no additions).

    Raises:
        ValueError: when a prompt ends with a visual token (its generation prompt must follow its images).
    """
    key, extras = next(iter(deepstack.items()))
    if bool(torch.stack([t[:, -1].ne(0).any(-1) for t in extras.dense]).any()):
        raise ValueError("a prompt ends with an image token: end it with text after its images (the chat template's "
                         "generation prompt)")
    prefix = {key: extras.select(lambda t: t[:, :-1])}
    where = {} if positions is None else {"position_ids": positions[..., :-1]}
    out = model.language_model(inputs_embeds=embeds[:, :-1], attention_mask=batch.attention_mask[:, :-1],
                               use_cache=True, **where, **prefix)
    return out.cache


def _mrope_prompt_positions(model: MultimodalModel, batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The prompt's M-RoPE positions ``[3, B, N]`` for an M-RoPE LLM given ``Batch.rope_position_ids``, else None
    (the LLM derives 1-D positions from the attention mask), and the first decoded token's positions ``[3, B, 1]``
    when ``generate`` alone would misplace it, else None. transformers' ``generate`` puts decoding step ``k`` at
    the prompt's last position ``+ 1 + k`` on each stream; Qwen2.5-VL's rule (``rope_deltas``) puts it at the
    prompt's largest position ``+ 1 + k`` (:func:`plait.data.mrope.next_mrope_positions`). The two agree when the
    prompt's last token is at its largest position; they differ after a video whose time positions run past the
    text that follows it (a clip of a few seconds): then the first token is decoded at the largest position
    ``+ 1`` before ``generate`` continues from it (:func:`greedy_token_ids`)."""
    positions = model.llm_positions(batch.position_ids, batch.rope_position_ids)
    if positions is None or positions.ndim != 3:
        return None, None
    following = next_mrope_positions(positions, batch.attention_mask).to(positions.device)
    return positions, None if torch.equal(positions[:, :, -1:] + 1, following) else following


def greedy_generate(model: MultimodalModel, batch: Batch, tokenizer: Any, stop_ids: Sequence[int],
                    max_new_tokens: int, pad_id: int,
                    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext) -> list[str]:
    """Greedy answers of ``model`` to a left-padded batch of prompts: :func:`greedy_token_ids` decoded by
    ``tokenizer`` with special tokens (stop tokens, padding) dropped.

    Raises:
        ValueError: as :func:`greedy_token_ids`.
    """
    out = greedy_token_ids(model, batch, stop_ids, max_new_tokens, pad_id, autocast)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def exact_match(prediction: str, reference: str) -> bool:
    """Whether a generated answer equals the reference, ignoring surrounding whitespace (the validation rule)."""
    return prediction.strip() == reference.strip()


def is_empty_answer(answer: str) -> bool:
    """Whether a generated answer is empty: nothing but whitespace once the stop and padding tokens are dropped (the
    model's first new token was a stop token, usual early in training, or it wrote only spaces or newlines before
    one). The one rule by which ``plait generate``
    marks empty answers (on stderr for ``--prompt``, ``"empty": true`` in ``--output`` lines) and evaluation marks them in
    ``predictions/step_<N>.jsonl``."""
    return not answer.strip()


@dataclass(frozen=True)
class Prompt:
    """One conversation to answer.

    Attributes:
        messages: ``({"role": ..., "content": ...}, ...)`` ending with the user's turn (roles ``system``, ``user``,
            ``assistant``); media placeholders (``<image>``, ``<audio>``, ``<video>``) in the text, one per item, in
            order.
        images, audios, videos: file paths, in placeholder order (videos go to an image branch that takes them).
        id: a name for error messages.
    """

    messages: tuple[Mapping[str, str], ...]
    images: tuple[str, ...] = ()
    audios: tuple[str, ...] = ()
    id: str = "prompt"
    videos: tuple[str, ...] = ()

    @classmethod
    def from_text(cls, text: str, images: Sequence[str] = (), audios: Sequence[str] = (),
                  placeholders: Mapping[str, str] | None = None, id: str = "prompt",
                  item_texts: Mapping[str, str] | None = None, videos: Sequence[str] = ()) -> "Prompt":
        """A one-turn prompt. When ``text`` holds no placeholder of a modality that has items, one placeholder
        per item is put before the text, each on its own line, images, then audio, then videos
        (``"<image>\\n<audio>\\nWhat ...?"``, the demo's layout). ``placeholders``: modality -> placeholder string
        (default ``<image>``, ``<audio>``, ``<video>``); ``item_texts``: modality -> the text put per item instead of
        the bare placeholder (a checkpoint's convention, :func:`item_prompt_text`)."""
        marks = {"image": "<image>", "audio": "<audio>", "video": "<video>"} | dict(placeholders or {})
        texts = marks | dict(item_texts or {})
        kinds = (("image", images), ("audio", audios), ("video", videos))
        head = "".join(f"{texts[m]}\n" * len(items) for m, items in kinds if items and marks[m] not in text)
        return cls(({"role": "user", "content": head + text},), tuple(images), tuple(audios), id, tuple(videos))

    def raw(self) -> RawSample:
        """The prompt as a :class:`RawSample` whose last (assistant) message is empty: what
        ``MultimodalProcessor(..., prompt_only=True)`` turns into the prompt with the generation prompt.

        Raises:
            ValueError: when the messages are empty or the last one is not the user's.
        """
        if not self.messages or self.messages[-1].get("role") != "user":
            raise ValueError(f"prompt {self.id!r}: the messages must end with the user's turn")
        messages = tuple({"role": m["role"], "content": m["content"]} for m in self.messages)
        return RawSample(self.id, "default", messages + ({"role": "assistant", "content": ""},),
                         {"image": self.images, "audio": self.audios, "video": self.videos}, "the prompt")


class Generator:
    """A trained model ready to answer: model (eval mode, frozen, on ``device``), tokenizer, processor and stop
    tokens.

    Args:
        model: the composite model.
        processor: turns records into model inputs (the one used in training, or :meth:`from_pretrained`'s).
        device: where the model runs; autocast to bf16 on CUDA when ``dtype`` is ``"auto"`` or ``"bf16"``.
        dtype: ``"auto"`` (bf16 on CUDA, fp32 on CPU: what training's validation uses), ``"bf16"`` or ``"fp32"``.

    Raises:
        ValueError: for an unknown ``dtype``.
    """

    def __init__(self, model: MultimodalModel, processor: MultimodalProcessor, device: torch.device | str = "cpu",
                 dtype: str = "auto") -> None:
        if dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"dtype must be 'auto', 'bf16' or 'fp32', got {dtype!r}")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.processor, self.tokenizer = processor, processor.tokenizer
        self.stop_ids = stop_token_ids(self.tokenizer, model.language_model.generation_config)
        bf16 = dtype == "bf16" or (dtype == "auto" and self.device.type == "cuda")
        self.autocast: Callable[[], AbstractContextManager[Any]] = (
            (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if bf16 else nullcontext)

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str = "auto", dtype: str = "auto",
                        attn_implementation: str = "sdpa") -> "Generator":
        """Load what ``plait train`` writes to ``<run_dir>/final``: the model (:meth:`MultimodalModel.from_pretrained`),
        ``tokenizer/`` (with its chat template) and ``processors/<encoder>/`` (each branch's Hugging Face image
        processor or feature extractor); the processor accepts prompts up to the LLM's
        ``max_position_embeddings`` tokens.

        Raises:
            FileNotFoundError: when ``directory``, its ``plait_config.json``, ``tokenizer/`` or a
                ``processors/<encoder>/`` folder is missing (naming it).
            ValueError: as :func:`resolve_device` and the loaders.
        """
        root = Path(directory)
        _require_final(root)
        dev = resolve_device(device)
        model = MultimodalModel.from_pretrained(root, attn_implementation=attn_implementation)
        tokenizer = load_tokenizer(str(root / "tokenizer"))
        return cls(model, inference_processor(root, model, tokenizer), dev, dtype)

    def process(self, prompts: Sequence[Prompt]) -> list[ProcessedSample]:
        """Each prompt rendered with the generation prompt, placeholders expanded, media decoded.

        Raises:
            SampleError: naming the prompt, for a missing or unreadable media file, a placeholder/item mismatch or
                a prompt longer than the processor's ``max_length``.
        """
        return [self.processor(p.raw(), prompt_only=True) for p in prompts]

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int = 16, batch_size: int = 16,
                 progress: Callable[[int], None] | None = None) -> list[str]:
        """Greedy answers to ``prompts``, in order (:meth:`generate_raw` of their :meth:`Prompt.raw`)."""
        return self.generate_raw([p.raw() for p in prompts], max_new_tokens, batch_size, progress)

    def generate_raw(self, samples: Sequence[RawSample], max_new_tokens: int = 16, batch_size: int = 16,
                     progress: Callable[[int], None] | None = None) -> list[str]:
        """Greedy answers to raw samples (records whose last message, the answer, is left out: the processor's
        ``prompt_only``), ``batch_size`` at a time in order; each batch is processed (media decoded) just before
        it runs, so memory holds one batch's media. ``progress(n)`` is called after each batch of ``n``.

        Raises:
            SampleError: as :meth:`process`.
            ValueError: as :meth:`generate_samples`.
        """
        _check_batch_size(batch_size)
        answers: list[str] = []
        for start in range(0, len(samples), batch_size):
            chunk = [self.processor(r, prompt_only=True) for r in samples[start : start + batch_size]]
            answers += self.generate_samples(chunk, max_new_tokens, batch_size)
            if progress is not None:
                progress(len(chunk))
        return answers

    def generate_samples(self, samples: Sequence[ProcessedSample], max_new_tokens: int = 16, batch_size: int = 16,
                         progress: Callable[[int], None] | None = None) -> list[str]:
        """Greedy answers to processed prompts (``prompt_only=True`` samples), ``batch_size`` at a time in order,
        each batch left-padded; ``progress(n)`` is called after each batch with its ``n`` samples.

        Raises:
            ValueError: when ``batch_size`` < 1, a sample holds its answer (not processed with ``prompt_only``),
                and as :func:`greedy_generate`.
        """
        _check_batch_size(batch_size)
        answers: list[str] = []
        for start in range(0, len(samples), batch_size):
            chunk = samples[start : start + batch_size]
            full = [s.meta.id for s in chunk if not s.prompt_only]
            if full:
                raise ValueError(f"sample {full[0]!r} holds its answer: process prompts with prompt_only=True")
            batch = collate(chunk, self.processor.pad_id, padding_side="left").to(self.device)
            answers += greedy_generate(self.model, batch, self.tokenizer, self.stop_ids, max_new_tokens,
                                       self.processor.pad_id, self.autocast)
            if progress is not None:
                progress(len(chunk))
        return answers

    def ask(self, text: str, images: Sequence[str] = (), audios: Sequence[str] = (), max_new_tokens: int = 16,
            videos: Sequence[str] = ()) -> str:
        """The greedy answer to one user message with these images, audio clips and videos (:meth:`prompt`)."""
        return self.generate([self.prompt(text, images, audios, videos)], max_new_tokens)[0]

    def prompt(self, text: str, images: Sequence[str] = (), audios: Sequence[str] = (),
               videos: Sequence[str] = ()) -> Prompt:
        """:meth:`Prompt.from_text` with this model's placeholder strings (:meth:`placeholders`), each item as the
        checkpoint's records write it (:meth:`item_texts`)."""
        return Prompt.from_text(text, images, audios, self.placeholders(), item_texts=self.item_texts(),
                                videos=videos)

    def placeholders(self) -> dict[str, str]:
        """Modality (``image``, ``audio``, ``video``) -> the model's placeholder string (the video's, for an image
        branch that takes videos)."""
        marks = {m: s.placeholder for m, s in self.processor.specs.items()}
        image = self.processor.specs.get("image")
        if image is not None and image.video is not None:
            marks["video"] = image.video.placeholder
        return marks

    def item_texts(self) -> dict[str, str]:
        """Modality -> the text a prompt without placeholders gets per item: :func:`item_prompt_text` of the
        model's placeholder (:meth:`placeholders`)."""
        texts = {m: item_prompt_text(mark, self.tokenizer) for m, mark in self.placeholders().items()}
        image = self.processor.specs.get("image")
        if "video" in texts and image.video.audio:  # a clip: its thinker's two tokens before and after it
            mark = image.video.placeholder
            for (vision, audio), (audio_end, vision_end) in (r.wrapper for r in THINKERS.values()):
                if texts["video"] == f"{vision}{mark}{vision_end}":
                    texts["video"] = f"{vision}{audio}{mark}{audio_end}{vision_end}"
        return texts


def _thinker_wrappers() -> dict[str, tuple[str, str]]:
    """Each Omni thinker's placeholders (:data:`plait.models.hf_io_omni.THINKERS`) -> the tokens around one item in
    its chat template: an image or video between its vision start and end, an audio clip between its audio start and
    end (the tokens its processor reads from the tokenizer, ``vision_bos_token`` ... ``audio_eos_token``)."""
    wrappers = {}
    for thinker in HF_THINKERS.values():
        image, audio, video = thinker.placeholders
        vision_start, vision_end, audio_start, audio_end = thinker.starts
        wrappers |= {image: (vision_start, vision_end), video: (vision_start, vision_end),
                     audio: (audio_start, audio_end)}
    return wrappers


ITEM_WRAPPERS = {"<|image_pad|>": ("<|vision_start|>", "<|vision_end|>"),
                 "<|video_pad|>": ("<|vision_start|>", "<|vision_end|>"),
                 "<|AUDIO|>": ("<|audio_bos|>", "<|audio_eos|>")} | _thinker_wrappers()
"""Placeholder -> the tokens around each item in the checkpoint's prompts: Qwen2-VL/Qwen2.5-VL's chat template
writes ``<|vision_start|><|image_pad|><|vision_end|>`` (``<|video_pad|>`` for a video; transformers' M-RoPE
positions find items by ``vision_start``), Qwen2-Audio's ``<|audio_bos|><|AUDIO|><|audio_eos|>``, the Qwen2.5-Omni
thinker's ``<|vision_bos|><|IMAGE|><|vision_eos|>`` (``<|VIDEO|>`` for a video; a video with its audio track also
inside ``<|audio_bos|>`` ... ``<|audio_eos|>``, :meth:`Generator.item_texts`), the Qwen3-Omni thinker's
``<|vision_start|><|image_pad|><|vision_end|>`` and ``<|audio_start|><|audio_pad|><|audio_end|>`` (its tokenizer's
``audio_bos_token`` and ``audio_eos_token``, which ``Qwen3OmniMoeProcessor`` reads; its ``get_rope_index`` counts
audio items by ``audio_start_token_id``) (the conventions the README gives for these imported models' records)."""


def item_prompt_text(placeholder: str, tokenizer: Any) -> str:
    """The text a prompt without placeholders gets per media item: ``placeholder`` between its
    :data:`ITEM_WRAPPERS` tokens when both are single tokens of ``tokenizer`` (an imported Qwen2.5-VL or
    Qwen2-Audio), else the bare placeholder."""
    wrap = ITEM_WRAPPERS.get(placeholder)
    vocab = tokenizer.get_vocab()
    if wrap is None or any(t not in vocab for t in wrap):
        return placeholder
    return f"{wrap[0]}{placeholder}{wrap[1]}"


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


def _require_final(root: Path) -> None:
    """Raise a :class:`FileNotFoundError` naming what ``plait train`` should have written to ``root``."""
    if not root.is_dir():
        raise FileNotFoundError(f"model folder {root} does not exist{path_note(root)}")
    if not (root / PLAIT_CONFIG).is_file():
        hint = (f"; did you mean {root / 'final'}?" if (root / "final" / PLAIT_CONFIG).is_file()
                else "; plait train writes the trained model to <metrics.run_dir>/final")
        raise FileNotFoundError(f"{root / PLAIT_CONFIG} does not exist: {root} is not a trained plait model{hint}")
    if not (root / "tokenizer").is_dir():
        raise FileNotFoundError(f"{root / 'tokenizer'} does not exist: the model folder needs the tokenizer that "
                                "plait train saves next to it")


def save_final(model: MultimodalModel, processor: MultimodalProcessor, directory: str | Path,
               merge_lora: bool = False) -> None:
    """Write what :meth:`Generator.from_pretrained` and a ``model.pretrained`` job load (``plait train``'s
    ``<run_dir>/final``): the model (:meth:`MultimodalModel.save_pretrained`, with each image branch's video
    settings, so videos are read as in training; ``llm/generation_config.json`` with :func:`with_stop_tokens`),
    ``tokenizer/`` and ``processors/<encoder>/``."""
    root = Path(directory)
    video = {s.encoder: {"placeholder": s.video.placeholder, "fps": s.video.fps, "max_frames": s.video.max_frames,
                         "audio": s.video.audio} for s in processor.specs.values() if s.video is not None}
    model.save_pretrained(root, merge_lora=merge_lora, video=video)
    if getattr(model.language_model, "generation_config", None) is not None:  # stop where plait's generation stops
        with_stop_tokens(model.language_model.generation_config, processor.tokenizer).save_pretrained(root / "llm")
    processor.tokenizer.save_pretrained(root / "tokenizer")
    for spec in processor.specs.values():
        spec.hf_processor.save_pretrained(root / "processors" / spec.encoder)


def inference_processor(root: Path, model: MultimodalModel, tokenizer: Any) -> MultimodalProcessor:
    """The :class:`MultimodalProcessor` of a ``final/`` folder, built as a ``model.pretrained`` job builds its
    processor (:func:`plait.models.registry.build_processor`): per branch its saved Hugging Face processor
    (``processors/<encoder>/``), placeholder (the token of the branch's placeholder id), feature-count function and
    video settings (``plait_config.json``; the defaults of ``[model.encoders.<name>.video]`` for a folder saved
    without them, ``VideoSpec.saved``: the folder, as nothing here sets them); prompts up to the LLM's
    ``max_position_embeddings`` tokens.

    Raises:
        FileNotFoundError: when a ``processors/<encoder>/`` folder is missing.
    """
    for name in model.encoders:
        folder = root / "processors" / name
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} does not exist: the model's {name!r} encoder needs the processor "
                                    "that plait train saves next to it")
    limit = getattr(model.language_model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    processor = build_processor(ModelConfig(pretrained=str(root)), model, tokenizer, int(limit))
    for modality, spec in processor.specs.items():  # no job table sets them: errors say what to give instead
        if spec.video is not None:
            video = dataclasses.replace(spec.video, saved=str(root))
            processor.specs[modality] = dataclasses.replace(spec, video=video)
    return processor
