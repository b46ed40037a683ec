"""Helpers of several test modules, taken from tests/unit/data/test_chat_templates.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.helpers.jobs import demo_records


ASSETS = Path(__file__).resolve().parents[1] / "assets" / "chat_templates"
PIECES = re.compile(r"\s|\w+|[^\w\s]")  # the tiny tokenizers' pre-tokenisation: each space, word, punctuation

# family -> (template file, bos, eos, pad, special tokens of the family)
FAMILIES = {
    "llama3_1": ("llama3_1.jinja", "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>",
                 ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"]),
    "qwen2_5": ("qwen2_5.jinja", None, "<|im_end|>", "<|endoftext|>", ["<|im_start|>"]),
    "gemma2": ("gemma2.jinja", "<bos>", "<eos>", "<pad>", ["<start_of_turn>", "<end_of_turn>"]),
    "mistral_v0_1": ("mistral_v0_1.jinja", "<s>", "</s>", None, []),
}

CONVERSATION = [
    {"role": "user", "content": "<image>\nWhich digit is this?"},
    {"role": "assistant", "content": "seven"},
    {"role": "user", "content": "And doubled?"},
    {"role": "assistant", "content": "fourteen"},
]


def build_tokenizer(family: str, out_dir: Path, template: str | None = None, split: str = PIECES.pattern) -> Path:
    """A word-level tokenizer for ``family`` (vocabulary: the template's and the demo set's words, and "\\n\\n")
    saved with save_pretrained to ``out_dir``; it carries the family's stock template (or ``template``) and
    pre-tokenizes with the regex ``split`` (default: each space, word and punctuation on its own)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    file, bos, eos, pad, extra = FAMILIES[family]
    text = (ASSETS / file).read_text()
    corpus = [text, *(json.dumps(r["messages"], ensure_ascii=False) for r in demo_records("train") + demo_records("val"))]
    corpus += [m["content"] for m in CONVERSATION] + ["You are terse."]
    vocab = {"[UNK]": 0, "\n\n": 1}
    for piece in sorted({p for line in corpus for p in PIECES.findall(line.replace("\\n", "\n"))}):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    tok.decoder = decoders.Fuse()
    specials = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", **{k: v for k, v in specials.items() if v},
        extra_special_tokens=[*extra, "<image>", "<audio>"], chat_template=template or text,
        clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(str(out_dir))
    return out_dir
