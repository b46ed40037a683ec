"""Stop tokens of tokenizers users bring (found by a fresh-user pass): a GPT-2-style tokenizer whose unknown token is
its EOS, and a ChatML end-of-turn token that is special in ``added_tokens_decoder`` only."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AddedToken, PreTrainedTokenizerFast

from plait.data.chat_template import read_chat_template
from plait.models.generation import stop_token_ids


def _tokenizer() -> PreTrainedTokenizerFast:
    words = ["<|endoftext|>", "user", "assistant", "x", "y", "\n"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", unk_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    tok.add_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.chat_template = read_chat_template("chatml")
    return tok


def test_eos_equal_to_unk_and_an_added_turn_end_both_stop():
    tok = _tokenizer()
    eos, im_end = tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")
    assert eos == tok.unk_token_id == 0
    assert stop_token_ids(tok) == sorted([eos, im_end])
