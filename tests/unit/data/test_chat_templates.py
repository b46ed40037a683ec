"""Stock chat templates (no ``{% generation %}`` markers): the trained tokens are found by rendering turn by turn.

The templates are the published ones of four families (tests/assets/chat_templates/, sources in its README);
the tokenizers are tiny word-level ones built here with each family's special tokens, so every expected mask
below is written by hand as text segments (1 = trained) whose tokens are whole words, spaces and punctuation.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from plait.config.schema import DataConfig, LLMConfig, ModelConfig
from plait.data.chat_template import (
    has_generation_markers,
    read_chat_template,
    render_with_assistant_mask,
    template_names,
    tokenizer_dir,
)
from plait.data.chat_template import _mask_by_prefixes  # the derivation itself, to compare with the markers
from plait.data.loader import MultimodalDataset
from plait.data.processing import IGNORE
from plait.data.sources import SampleError, parse_record
from plait.models.registry import build_model, build_processor, load_tokenizer
from tests.helpers.jobs import DEMO, TINY_LLM, demo_records, write_jsonl
from tests.helpers.chat_templates import ASSETS, CONVERSATION, FAMILIES, PIECES, build_tokenizer


LLAMA_SYSTEM = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December "
                "2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>")
QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"

# Hand-written: the whole rendering of CONVERSATION as (text, trained) segments. Trained = the answer and the
# template's end-of-turn token; the separator after it (newline, space) and everything else is not.
EXPECTED = {
    "llama3_1": [
        (LLAMA_SYSTEM + "<|start_header_id|>user<|end_header_id|>\n\n<image>\nWhich digit is this?<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ("seven<|eot_id|>", 1),
        ("<|start_header_id|>user<|end_header_id|>\n\nAnd doubled?<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ("fourteen<|eot_id|>", 1),
    ],
    "qwen2_5": [
        (QWEN_SYSTEM + "<|im_start|>user\n<image>\nWhich digit is this?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("seven<|im_end|>", 1),
        ("\n<|im_start|>user\nAnd doubled?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("fourteen<|im_end|>", 1),
        ("\n", 0),
    ],
    "gemma2": [
        ("<bos><start_of_turn>user\n<image>\nWhich digit is this?<end_of_turn>\n<start_of_turn>model\n", 0),
        ("seven<end_of_turn>", 1),
        ("\n<start_of_turn>user\nAnd doubled?<end_of_turn>\n<start_of_turn>model\n", 0),
        ("fourteen<end_of_turn>", 1),
        ("\n", 0),
    ],
    "mistral_v0_1": [
        ("<s>[INST] <image>\nWhich digit is this? [/INST]", 0),
        ("seven</s>", 1),
        (" [INST] And doubled? [/INST]", 0),
        ("fourteen</s>", 1),
        (" ", 0),
    ],
}


def _words(text: str, specials: list[str]) -> list[str]:
    """The tiny tokenizer's tokens of ``text``: special tokens whole, the rest split by PIECES."""
    pattern = "(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
    out = []
    for part in re.split(pattern, text):
        out += [part] if part in specials else PIECES.findall(part)
    return out


def family_specials(family: str) -> list[str]:
    _, bos, eos, pad, extra = FAMILIES[family]
    return [t for t in (bos, eos, pad) if t] + extra + ["<image>", "<audio>"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {f: load_tokenizer(str(build_tokenizer(f, root / f))) for f in FAMILIES}


@pytest.fixture(scope="module")
def processors(tokenizers):
    from plait.config.loader import config_from_dict
    from tests.helpers.jobs import tiny_config_dict

    cfg = config_from_dict(tiny_config_dict("unused.jsonl"))
    out = {}
    for family, tok in tokenizers.items():
        model = build_model(cfg.model, tok)
        out[family] = (model, build_processor(cfg.model, model, tok, 256))
    return out


def image_record(messages=CONVERSATION, rid="two-turns"):
    img = demo_records("train", ("image_digit",), limit=1)[0]["images"]
    return {"id": rid, "task": "chat", "messages": list(messages), "images": img, "audios": []}


def test_the_committed_assets_are_stock_templates_without_generation_markers():
    names = sorted(p.stem for p in ASSETS.glob("*.jinja"))
    assert names == sorted(FAMILIES)
    for name in names:
        assert not has_generation_markers((ASSETS / f"{name}.jinja").read_text())
    assert has_generation_markers((DEMO / "tokenizer" / "chat_template.jinja").read_text())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stock_template_marks_exactly_the_answers_and_their_end_of_turn(tokenizers, family):
    tok = tokenizers[family]
    segments = EXPECTED[family]
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == "".join(text for text, _ in segments)
    expected = [flag for text, flag in segments for _ in _words(text, family_specials(family))]
    ids, mask = render_with_assistant_mask(tok, CONVERSATION)
    assert len(ids) == len(expected) and tok.unk_token_id not in ids
    assert mask == expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_processing_labels_are_the_answers_with_the_image_placeholder_expanded(tokenizers, processors, family):
    tok = tokenizers[family]
    model, proc = processors[family]
    s = proc(parse_record(image_record(), "chat.jsonl:1", DEMO))
    # hand-written mask, expanded: the one <image> token becomes n placeholder tokens (never trained)
    n = int((s.input_ids == model.placeholder_ids["vision"]).sum())
    h, w = s.inputs["vision"][0]["pixel_values"].shape[-2:]
    assert n == (h // 8) * (w // 8) > 1
    mask = []
    for text, flag in EXPECTED[family]:
        for word in _words(text, family_specials(family)):
            mask += [0] * n if word == "<image>" else [flag]
    assert len(mask) == len(s.input_ids)
    trained = torch.tensor(mask[1:] + [0], dtype=torch.bool)  # labels[t] is the target of position t
    expected = torch.where(trained, torch.roll(s.input_ids, -1), torch.full_like(s.input_ids, IGNORE))
    assert torch.equal(s.labels, expected)
    eot = EXPECTED[family][1][0].removeprefix("seven")
    assert tok.decode(s.labels[s.labels != IGNORE]) == f"seven{eot}fourteen{eot}"
    assert s.meta.target_tokens == 2 + 2 * len(_words(eot, family_specials(family)))
    # validation prompts end with the generation prompt (Mistral v0.1 has none: its prompt ends at [/INST])
    prompt = proc(parse_record(image_record(), "chat.jsonl:1", DEMO), prompt_only=True)
    assert (prompt.labels == IGNORE).all()
    head = "".join(t for t, _ in EXPECTED[family][:3])
    assert tok.decode(prompt.input_ids[prompt.input_ids != model.placeholder_ids["vision"]]) == head.replace(
        "<image>", "", 1)


def test_the_derivation_agrees_with_generation_markers_on_the_demo_tokenizer():
    tok = load_tokenizer(str(DEMO / "tokenizer"))
    records = demo_records("train", limit=40)
    multi = [{"role": "system", "content": "You are terse."}, *CONVERSATION]
    for messages in [r["messages"] for r in records] + [CONVERSATION, multi]:
        assert _mask_by_prefixes(tok, messages) == render_with_assistant_mask(tok, messages)


def test_chatml_is_a_committed_template_equal_to_the_demo_one(tmp_path):
    assert "chatml" in template_names()
    tok = load_tokenizer(str(build_tokenizer("qwen2_5", tmp_path / "q")), "chatml")
    assert tok.chat_template == read_chat_template("chatml")
    demo = load_tokenizer(str(DEMO / "tokenizer"))
    multi = [{"role": "system", "content": "You are terse."}, *CONVERSATION]
    assert tok.apply_chat_template(multi, tokenize=False) == demo.apply_chat_template(multi, tokenize=False)
    # with the override the markers decide: the same mask as the stock Qwen2.5 template's answers
    ids, mask = render_with_assistant_mask(tok, CONVERSATION)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "seven<|im_end|>fourteen<|im_end|>"


def test_chat_template_override_from_a_file_and_a_bad_name(tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text((ASSETS / "gemma2.jinja").read_text())
    tok = load_tokenizer(str(build_tokenizer("gemma2", tmp_path / "g", template="{{ 'x' }}")), str(path))
    assert tok.apply_chat_template(CONVERSATION[:2], tokenize=False).startswith("<bos><start_of_turn>user")
    with pytest.raises(ValueError, match=r"data.chat_template: 'nope' is neither a Jinja file .* \(chatml"):
        load_tokenizer(str(tmp_path / "g"), "nope")


@pytest.mark.parametrize("family, pattern", [
    ("gemma2", r"System role not supported"),
    ("mistral_v0_1", r"Conversation roles must alternate|Only user and assistant roles are supported"),
])
def test_a_template_that_refuses_a_system_message_names_the_record(tokenizers, processors, tmp_path, family,
                                                                    pattern):
    _, proc = processors[family]
    good = image_record(rid="good")
    bad = image_record([{"role": "system", "content": "You are terse."}, *CONVERSATION], rid="with-system")
    path = write_jsonl(tmp_path / "chat.jsonl", [good, bad])
    with pytest.raises(SampleError, match=pattern) as info:
        MultimodalDataset(path, proc, on_error="raise")
    text = str(info.value)
    assert f"record 'with-system' ({path}:2)" in text
    assert "[roles: system -> user -> assistant -> user -> assistant]" in text
    assert "merge it into the first user message" in text and "data.chat_template" in text
    assert len(MultimodalDataset(path, proc, on_error="skip")) == 1


@pytest.mark.parametrize("family", ["llama3_1", "qwen2_5"])
def test_templates_with_a_system_role_train_its_answers_only(tokenizers, family):
    tok = tokenizers[family]
    messages = [{"role": "system", "content": "You are terse."}, *CONVERSATION]
    ids, mask = render_with_assistant_mask(tok, messages)
    eot = EXPECTED[family][1][0].removeprefix("seven")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == f"seven{eot}fourteen{eot}"
    assert "You are terse." in tok.decode(ids)


def test_roles_that_do_not_alternate_are_refused_by_gemma_naming_the_record(processors, tmp_path):
    _, proc = processors["gemma2"]
    rec = image_record([CONVERSATION[0], {"role": "user", "content": "Well?"}, CONVERSATION[1]], rid="two-users")
    path = write_jsonl(tmp_path / "chat.jsonl", [rec])
    with pytest.raises(SampleError, match=r"record 'two-users' .*:1\): chat template failed: Conversation roles "
                                          r"must alternate.*do not alternate starting with the user"):
        MultimodalDataset(path, proc, on_error="raise")


def test_a_template_that_renders_earlier_turns_differently_is_refused_naming_the_record(tokenizers, tmp_path):
    # like zephyr-gemma: the end-of-sequence token only after the conversation's last assistant message
    template = ("{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] + '<end_of_turn>' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>assistant\n' }}"
                "{% elif messages[-1]['role'] == 'assistant' %}{{ eos_token }}{% endif %}")
    tok = load_tokenizer(str(build_tokenizer("gemma2", tmp_path / "g", template=template)))
    ids, mask = render_with_assistant_mask(tok, CONVERSATION[:2])  # one answer: fine, the <eos> is trained
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "seven<end_of_turn><eos>"
    from plait.config.loader import config_from_dict
    from tests.helpers.jobs import tiny_config_dict

    cfg = config_from_dict(tiny_config_dict("unused.jsonl"))
    proc = build_processor(cfg.model, build_model(cfg.model, tok, device="meta"), tok, 256)
    path = write_jsonl(tmp_path / "chat.jsonl", [image_record(rid="eos-at-end")])
    with pytest.raises(SampleError, match=r"record 'eos-at-end' \(.*chat.jsonl:1\): the chat template cannot be "
                                          r"split into turns: message 1 \(assistant\).*'<eos>' vs '<start_of_turn>'"):
        MultimodalDataset(path, proc, on_error="raise")


def test_the_tokenizer_defaults_to_the_llm_folder(tmp_path):
    llm = tmp_path / "llm"
    llm.mkdir()
    model = ModelConfig(llm=LLMConfig(path=str(llm)))
    with pytest.raises(ValueError, match=r"data.tokenizer is not set .*model.llm.path = '.*llm' holds no "
                                         r"tokenizer_config.json or tokenizer.json.*set data.tokenizer"):
        tokenizer_dir(DataConfig(), model)
    with pytest.raises(ValueError, match=r"model.llm is built from a config, not a folder"):
        tokenizer_dir(DataConfig(), ModelConfig(llm=LLMConfig(config=dict(TINY_LLM))))
    build_tokenizer("llama3_1", llm)
    assert tokenizer_dir(DataConfig(), model) == str(llm)
    assert tokenizer_dir(DataConfig(tokenizer="elsewhere"), model) == "elsewhere"
    final = tmp_path / "final"
    build_tokenizer("qwen2_5", final / "tokenizer")
    assert tokenizer_dir(DataConfig(), ModelConfig(pretrained=str(final))) == str(final / "tokenizer")


def test_a_short_run_trains_with_a_stock_template_and_the_tokenizer_of_the_llm_folder(tiny_job, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait.train.trainer import Trainer

    llm = tmp_path / "qwen_like_llm"
    tok = load_tokenizer(str(build_tokenizer("qwen2_5", llm)))
    torch.manual_seed(0)
    fields = {k: v for k, v in TINY_LLM.items() if k != "model_type"}
    LlamaForCausalLM(LlamaConfig(**fields, vocab_size=len(tok))).save_pretrained(str(llm))
    recs = demo_records("train", ("image_digit", "text"), limit=8)
    cfg = tiny_job(recs, model={"llm": {"path": str(llm), "attn_implementation": "eager"}},
                   data={"tokenizer": "", "shuffle": False},
                   train={"steps": 6, "global_batch_size": 4, "microbatch_size": 2, "lr": 3e-3})
    trainer = getattr(Trainer, "build", Trainer)(cfg)  # Trainer.build once the train/ restructuring lands
    assert trainer.tokenizer.chat_template == (ASSETS / "qwen2_5.jinja").read_text()
    for sample, rec in zip(trainer.train_set.samples, recs):
        targets = sample.labels[sample.labels != IGNORE]
        assert trainer.tokenizer.decode(targets) == rec["messages"][-1]["content"].strip() + "<|im_end|>"
    losses = trainer.fit()["losses"]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


def test_a_token_across_the_prompt_and_answer_boundary_is_refused_naming_the_tokens(tmp_path):
    # GPT-2's whitespace rule keeps "\n\n" whole at the end of a text but splits it before a word, so the
    # Llama-3.1 generation prompt (ending "\n\n") is not a token prefix of the conversation; the real Llama-3
    # pre-tokenizer keeps newline runs whole (\s*[\r\n]+) and has no such problem
    tok = load_tokenizer(str(build_tokenizer("llama3_1", tmp_path / "l", split=r"\s+(?!\S)|\s+|\w+|[^\w\s]")))
    with pytest.raises(SampleError, match=r"message 1 \(assistant\): messages 0..0 with the generation prompt renders "
                                          r"tokens that are not found at token 0 of the whole conversation \(they "
                                          r"first differ at token \d+: '\\n\\n' vs '\\n'\)"):
        render_with_assistant_mask(tok, CONVERSATION)


def test_a_missing_llm_folder_is_named_as_such_not_as_a_tokenizer_problem(tmp_path):
    missing = str(tmp_path / "no-such-llm")
    for data in (DataConfig(), DataConfig(tokenizer=str(DEMO / "tokenizer"))):
        with pytest.raises(ValueError, match=r"model.llm.path = '.*no-such-llm' does not exist: give the local "
                                             r"Hugging Face folder") as err:
            tokenizer_dir(data, ModelConfig(llm=LLMConfig(path=missing)))
        assert "tokenizer" not in str(err.value)
