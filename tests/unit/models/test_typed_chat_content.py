"""Chat templates take both message forms: plait's string contents and transformers' typed parts
(``[{"type": "image"}, {"type": "text", "text": ...}]``), in plait's committed ChatML and in what an export writes;
saved model files are readable as the umask allows (safetensors writes 0600)."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from plait.data.chat_template import read_chat_template
from plait.models.file_modes import share_saved_files
from plait.models.hf_io import export_chat_template
from plait.models.registry import load_tokenizer
from tests.helpers.jobs import DEMO

STRING_ONLY_CHATML = (  # plait's ChatML as committed before typed parts: string contents only
    "{%- for message in messages -%}{%- if message['role'] == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")

STRING = [{"role": "system", "content": "You are terse."},
          {"role": "user", "content": "<image>\nWhich digit is this? <audio>"},
          {"role": "assistant", "content": "seven"}]
TYPED = [{"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
         {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhich digit is this? "},
                                      {"type": "audio"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "seven"}]}]
EXPECTED = ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n<image>\nWhich digit is this? "
            "<audio><|im_end|>\n<|im_start|>assistant\nseven<|im_end|>\n")


@pytest.mark.parametrize("template", ["demo", "chatml"])
def test_plaits_chatml_renders_string_and_typed_contents_alike(template):
    tok = load_tokenizer(str(DEMO / "tokenizer"), "" if template == "demo" else template)
    assert tok.apply_chat_template(STRING, tokenize=False) == EXPECTED
    assert tok.apply_chat_template(TYPED, tokenize=False) == EXPECTED
    typed = tok.apply_chat_template(TYPED, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    string = tok.apply_chat_template(STRING, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert typed["input_ids"] == string["input_ids"] and typed["assistant_masks"] == string["assistant_masks"]
    answer = [i for i, m in zip(typed["input_ids"], typed["assistant_masks"]) if m]
    assert tok.decode(answer) == "seven<|im_end|>"


def test_chatml_names_a_part_it_cannot_render():
    tok = load_tokenizer(str(DEMO / "tokenizer"), "chatml")
    with pytest.raises(Exception, match="part of type image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "url": "x"}]}], tokenize=False)


def test_an_export_of_a_string_only_template_takes_typed_contents():
    tok = load_tokenizer(str(DEMO / "tokenizer"))
    tok.chat_template = STRING_ONLY_CHATML
    with pytest.raises(TypeError):  # what users hit on the exported LLaVA processor
        tok.apply_chat_template(TYPED, tokenize=False)
    template = export_chat_template(tok, "<image>")
    assert tok.chat_template == template and template.endswith(STRING_ONLY_CHATML)
    assert tok.apply_chat_template(STRING, tokenize=False) == EXPECTED
    assert tok.apply_chat_template(TYPED[:1] + [{"role": "user", "content": [{"type": "image"}]}], tokenize=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n<image><|im_end|>\n")
    # a template that takes typed contents is written as it is
    tok.chat_template = read_chat_template("chatml")
    assert export_chat_template(tok, "<image>") == read_chat_template("chatml")


def test_saved_safetensors_files_get_the_umask_mode(tmp_path):
    path = tmp_path / "a" / "model.safetensors"
    path.parent.mkdir()
    save_file({"w": torch.zeros(2)}, str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # safetensors' own mode
    old = os.umask(0o022)
    try:
        assert share_saved_files(tmp_path) == 1
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        assert share_saved_files(tmp_path) == 0
    finally:
        os.umask(old)
