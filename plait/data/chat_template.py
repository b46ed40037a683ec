"""Chat templates: render a conversation to token ids and mark the assistant's tokens, for any template.

Two ways to find the trained tokens (the assistant's answers, each with the template's end-of-turn token):

- a template whose assistant turns are wrapped in ``{% generation %}`` ... ``{% endgeneration %}`` marks them
  itself (``return_assistant_tokens_mask`` of transformers);
- any other template (every published one: Llama-3, Qwen2 ChatML, Gemma, Mistral, ...) is rendered turn by
  turn: for assistant message ``k``, the tokens of messages ``[0, k)`` with the generation prompt must be a
  token prefix of the whole conversation's tokens, and the assistant's span is what rendering messages
  ``[0, k]`` adds after that prefix, minus trailing whitespace after its end-of-turn token (the separator
  before the next turn, which the model need not emit); that span must also appear at the same place in the
  whole conversation. When a template breaks these rules (it renders an earlier turn differently once later
  turns follow, or a token straddles the prompt/answer boundary) the record is refused with the reason.

``data.chat_template`` replaces a tokenizer's template with a Jinja file or a template committed with plait
(:data:`TEMPLATE_DIR`); ``data.tokenizer`` defaults to the LLM's folder (:func:`tokenizer_dir`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from plait.config.schema import DataConfig, ModelConfig
from plait.data.sources import SampleError, path_note

__all__ = [
    "TEMPLATE_DIR",
    "missing_pretrained",
    "template_names",
    "read_chat_template",
    "has_generation_markers",
    "tokenizer_dir",
    "render_prompt",
    "render_with_assistant_mask",
]

TEMPLATE_DIR = Path(__file__).resolve().parent / "chat_templates"
"""Templates committed with plait, by file stem (``data.chat_template = "chatml"``)."""

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def missing_pretrained(path: str) -> str:
    """The message for a ``model.pretrained`` folder that does not exist: what belongs there and how to make it."""
    return (f"model.pretrained = {path!r} does not exist: it is a plait model folder, a run's final/ (train that run "
            "first; for runs/demo/final: `make demo`) or the model/ folder `plait import --from <Hugging Face folder> "
            "--out <dir>` writes (a recipe's header names the checkpoint to download and import)")


def template_names() -> list[str]:
    """Names of the committed templates (files ``TEMPLATE_DIR/<name>.jinja``), sorted."""
    return sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))


def read_chat_template(value: str) -> str:
    """The Jinja text of ``data.chat_template``: a path to a file, or the name of a committed template.

    Raises:
        ValueError: when ``value`` is neither an existing file nor a committed template's name, or when the
            template is not valid Jinja (``data.chat_template <value> line <n>: <reason>``).
    """
    path = Path(value)
    if path.is_file():
        return _checked_template(path.read_text(encoding="utf-8"), value)
    named = TEMPLATE_DIR / f"{value}.jinja"
    if "/" not in value and named.is_file():
        return _checked_template(named.read_text(encoding="utf-8"), value)
    raise ValueError(
        f"data.chat_template: {value!r} is neither a Jinja file (paths are relative to the working directory) "
        f"nor a template committed with plait ({', '.join(template_names())})"
    )


def _checked_template(text: str, value: str) -> str:
    """``text`` once it compiles in the environment transformers renders chat templates with (jinja2's
    sandbox plus the ``{% generation %}`` tag and loop controls, cached there), so that a syntax error is
    reported against the template, not against the first record rendered with it.

    Raises:
        ValueError: ``data.chat_template <value> line <n>: <jinja2's reason>``.
    """
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"data.chat_template {value} line {exc.lineno}: {exc.message}") from exc
    return text


def has_generation_markers(template: str | None) -> bool:
    """Whether ``template`` wraps assistant turns in ``{% generation %}`` blocks."""
    return bool(template) and _GENERATION.search(template) is not None


def tokenizer_dir(data: DataConfig, model: ModelConfig) -> str:
    """The tokenizer directory of a job: ``data.tokenizer`` when set, else the LLM's folder
    (``model.llm.path``, or ``<model.pretrained>/tokenizer`` for a plait checkpoint) when it holds a tokenizer
    (``tokenizer_config.json`` or ``tokenizer.json``).

    Raises:
        ValueError: when ``model.llm.path`` names a folder that does not exist, ``data.tokenizer`` is empty and no
            such folder holds a tokenizer, or ``model.pretrained`` names a folder that does not exist.
    """
    if model.llm.path and not Path(model.llm.path).is_dir():  # the model's folder, before any tokenizer question
        raise ValueError(f"model.llm.path = {model.llm.path!r} does not exist{path_note(model.llm.path)}: give the "
                         "local Hugging Face folder of the LLM (plait loads no weights from a hub)")
    if data.tokenizer:
        return data.tokenizer
    if model.pretrained and not Path(model.pretrained).is_dir():
        raise ValueError(missing_pretrained(model.pretrained))
    candidates = [(f"model.llm.path = {model.llm.path!r}", model.llm.path)]
    if model.pretrained:
        candidates.insert(0, (f"model.pretrained = {model.pretrained!r} (its tokenizer/ folder)",
                              str(Path(model.pretrained) / "tokenizer")))
    for _, folder in candidates:
        if folder and any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES):
            return folder
    looked = "; ".join(f"{what} holds no {' or '.join(_TOKENIZER_FILES)}" for what, folder in candidates if folder)
    raise ValueError("data.tokenizer is not set and there is no tokenizer to default to"
                     + (f" ({looked})" if looked else " (model.llm is built from a config, not a folder)")
                     + ": set data.tokenizer to a Hugging Face tokenizer directory")


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` followed by the template's generation prompt (for generation).

    Raises:
        SampleError: when the template refuses the conversation.
    """
    enc = _apply(tokenizer, messages, add_generation_prompt=True, return_assistant_tokens_mask=False)
    return list(enc["input_ids"])


def render_with_assistant_mask(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and a 0/1 mask of the assistant's tokens (answer + end-of-turn).

    Uses the template's ``{% generation %}`` markers when it has them, otherwise renders turn by turn
    (module docstring).

    Raises:
        SampleError: when the template refuses the conversation (e.g. a system message, or roles that do not
            alternate), or renders it so that the assistant's tokens cannot be located.
    """
    if has_generation_markers(tokenizer.chat_template):
        enc = _apply(tokenizer, messages, add_generation_prompt=False, return_assistant_tokens_mask=True)
        ids = list(enc["input_ids"])
        return ids, list(enc.get("assistant_masks", [0] * len(ids)))
    return _mask_by_prefixes(tokenizer, messages)


def _mask_by_prefixes(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    full = _ids(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(full)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _ids(tokenizer, messages[:k], add_generation_prompt=True)
        turn = _ids(tokenizer, messages[: k + 1], add_generation_prompt=False)
        where = f"message {k} (assistant)"
        _require_prefix(tokenizer, before, full, 0, f"{where}: messages 0..{k - 1} with the generation prompt")
        _require_prefix(tokenizer, before, turn, 0, f"{where}: messages 0..{k - 1} with the generation prompt",
                        "the conversation up to this answer")
        span = _strip_trailing_space(tokenizer, turn[len(before):])
        _require_prefix(tokenizer, span, full, len(before), f"{where}: the answer as rendered when it is last")
        mask[len(before) : len(before) + len(span)] = [1] * len(span)
    return full, mask


def _strip_trailing_space(tokenizer: Any, span: list[int]) -> list[int]:
    """``span`` without its trailing whitespace-only tokens (what follows the end-of-turn token)."""
    end = len(span)
    while end > 0 and not tokenizer.decode([span[end - 1]]).strip():
        end -= 1
    return span[:end]


def _require_prefix(tokenizer: Any, part: list[int], whole: list[int], start: int, what: str,
                    of: str = "the whole conversation") -> None:
    """Raise unless ``whole[start : start + len(part)] == part``, showing the first differing token."""
    got = whole[start : start + len(part)]
    if got == part:
        return
    i = next((j for j, (a, b) in enumerate(zip(part, got)) if a != b), len(got))
    shown = [repr(tokenizer.decode([t[i]])) if i < len(t) else "the end" for t in (part, got)]
    raise SampleError(
        f"the chat template cannot be split into turns: {what} renders tokens that are not found at token "
        f"{start} of {of} (they first differ at token {start + i}: {shown[0]} vs {shown[1]}), so the assistant's "
        "tokens cannot be located: the template renders a turn differently once later turns follow, or the "
        "tokenizer merges the end of the prompt and the start of the answer into one token; set "
        "data.chat_template to a template without that, or one that marks answers with {% generation %}"
    )


def _ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    enc = _apply(tokenizer, messages, add_generation_prompt=add_generation_prompt, return_assistant_tokens_mask=False)
    return list(enc["input_ids"])


def _apply(tokenizer: Any, messages: list[dict[str, str]], **kwargs: Any) -> Any:
    """``tokenizer.apply_chat_template`` (tokenized, as a dict), its failures as a :class:`SampleError`."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    except Exception as exc:
        raise SampleError(f"chat template failed: {exc}{_refusal_hint(messages)}") from exc


def _refusal_hint(messages: list[dict[str, str]]) -> str:
    """What in the conversation a stock template commonly refuses (Gemma, Mistral), for the error message."""
    roles = [m["role"] for m in messages]
    hints = []
    if "system" in roles:
        hints.append("it has a system message, which some templates (Gemma, Mistral) refuse: merge it into the "
                     "first user message")
    turns = [r for r in roles if r != "system"]
    if turns[:1] != ["user"] or any(a == b for a, b in zip(turns, turns[1:])):
        hints.append("its user/assistant turns do not alternate starting with the user, which some templates "
                     "require")
    sequence = " -> ".join(roles) if roles else "no messages"
    suffix = f" ({'; '.join(hints)}; or set data.chat_template)" if hints else ""
    return f" [roles: {sequence}]{suffix}"
