"""Generation as a library (plait.models.generation): a tiny model trained a few steps and saved as ``plait train``
saves ``final/`` answers like the trainer's validation, batched like one by one, and stops on the template's
turn end."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationConfig

from plait.data.collate import collate
from plait.data.sources import SampleError
from plait.models.generation import Generator, Prompt, exact_match, greedy_token_ids, stop_token_ids
from plait.models.registry import load_tokenizer
from plait.train.trainer import Trainer
from tests.helpers.jobs import demo_records
from tests.unit.models.generation_cases import save_final, task_records, train_final, trainer_predictions


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """generation_cases.train_final: (trainer, final/, validation exact match per task, val.jsonl)."""
    return train_final(tmp_path_factory.mktemp("gen"))


def test_library_answers_like_training_validation(trained):
    trainer, final, evals, _ = trained
    gen = Generator.from_pretrained(final, device="cpu")
    val = [trainer.val_set[j] for j in range(len(trainer.val_set))]
    prompts = [Prompt(tuple(r["messages"][:-1]), tuple(r["images"]), tuple(r["audios"]), r["id"])
               for r in task_records("train", 2) + task_records("val", 2)]
    samples = gen.process(prompts)
    for mine, theirs in zip(samples, val):  # the inference processor reproduces training's prompts
        assert torch.equal(mine.input_ids, theirs.input_ids), theirs.meta.id
    predictions = gen.generate_samples(samples, max_new_tokens=6)
    assert predictions == trainer_predictions(trainer)
    by_task = {}
    for s, p in zip(val, predictions):
        by_task.setdefault(s.meta.task, []).append(exact_match(p, s.answer))
    assert {t: sum(v) / len(v) for t, v in by_task.items()} == evals
    assert 0 < sum(evals.values()) < len(evals)  # some right, some wrong: the comparison can fail
    assert gen.stop_ids == [2, 4]  # <|eos|>, <|im_end|>; the LLM's generation config names <|eos|> too


def test_batched_answers_equal_one_by_one(trained):
    _, final, _, _ = trained
    gen = Generator.from_pretrained(final, device="cpu")
    prompts = [Prompt.from_text(r["messages"][0]["content"], r["images"], r["audios"], id=r["id"])
               for r in task_records("val", 3)]
    samples = gen.process(prompts)
    assert len({len(s.input_ids) for s in samples}) > 3  # rows of different lengths: left padding matters
    one_by_one = [gen.generate_samples([s], max_new_tokens=6)[0] for s in samples]
    assert gen.generate_samples(samples, max_new_tokens=6, batch_size=5) == one_by_one
    assert gen.generate(prompts, max_new_tokens=6, batch_size=12) == one_by_one
    assert len(set(one_by_one)) > 1
    rec = task_records("val", 1)[0]
    assert gen.ask(rec["messages"][0]["content"].replace("<image>", ""), images=rec["images"],
                   max_new_tokens=6) == one_by_one[0]  # the placeholder is put back in front, as the demo has it
    done = []
    gen.generate_samples(samples, max_new_tokens=2, batch_size=5, progress=done.append)
    assert done == [5, 5, 2]


def test_prompts_name_what_is_wrong(trained, tmp_path):
    _, final, _, _ = trained
    gen = Generator.from_pretrained(final, device="cpu")
    missing = str(tmp_path / "nope.png")
    with pytest.raises(SampleError, match=rf"record 'prompt' \(the prompt\): image file {missing} does not exist"):
        gen.ask("Which digit?", images=[missing])
    with pytest.raises(SampleError, match=r"2 <image> placeholder\(s\) in the text but 1 image item"):
        gen.ask("<image><image> which?", images=[task_records("val", 1)[0]["images"][0]])
    with pytest.raises(ValueError, match="prompt 'p': the messages must end with the user's turn"):
        gen.generate([Prompt(({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}), id="p")])
    with pytest.raises(ValueError, match="sample 'train-img-.*' holds its answer: process prompts with prompt_only"):
        gen.generate_samples([gen.processor(_raw(trained[3]))])
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        gen.generate_samples([], batch_size=0)


def _raw(val_path):
    from plait.data.sources import parse_record, read_jsonl

    obj, where, _ = read_jsonl(val_path)[0]
    return parse_record(obj, where, val_path.parent)


def test_a_folder_that_is_not_final_is_named(trained, tmp_path):
    _, final, _, _ = trained
    run = final.parent
    with pytest.raises(FileNotFoundError, match=rf"{run / 'plait_config.json'} does not exist: {run} is not a "
                                                rf"trained plait model; did you mean {final}\?"):
        Generator.from_pretrained(run, device="cpu")
    with pytest.raises(FileNotFoundError, match=rf"model folder {tmp_path / 'x'} does not exist"):
        Generator.from_pretrained(tmp_path / "x", device="cpu")
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(final, partial)
    shutil.rmtree(partial / "processors" / "audio")
    with pytest.raises(FileNotFoundError, match=rf"{partial / 'processors' / 'audio'} does not exist: the model's "
                                                r"'audio' encoder needs the processor"):
        Generator.from_pretrained(partial, device="cpu")
    shutil.rmtree(partial / "tokenizer")
    with pytest.raises(FileNotFoundError, match=rf"{partial / 'tokenizer'} does not exist"):
        Generator.from_pretrained(partial, device="cpu")


def test_stop_tokens_of_a_template_whose_turn_ends_otherwise_are_honoured(tiny_job, tmp_path):
    """Gemma-2's template ends a turn with <end_of_turn>; a model trained to answer "seven" stops right there."""
    from tests.helpers.chat_templates import build_tokenizer

    tok_dir = build_tokenizer("gemma2", tmp_path / "gemma_tok")
    tok = load_tokenizer(str(tok_dir))
    eos, eot = tok.convert_tokens_to_ids("<eos>"), tok.convert_tokens_to_ids("<end_of_turn>")
    assert stop_token_ids(tok) == sorted([eos, eot]) and tok.convert_tokens_to_ids("<|im_end|>") == tok.unk_token_id
    start = tok.convert_tokens_to_ids("<start_of_turn>")
    word = tok.convert_tokens_to_ids("seven")
    # generation-config ids join only when the tokenizer marks them special (LlamaConfig's default 2 is a word here)
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=[word, start])) == sorted([eos, eot, start])
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=2)) == sorted([eos, eot]) and 2 not in tok.all_special_ids

    recs = [dict(r, messages=[r["messages"][0], {"role": "assistant", "content": "seven"}])
            for r in demo_records("train", ("text", "image_digit"), limit=8)]
    trainer = Trainer.build(tiny_job(recs, data={"tokenizer": str(tok_dir)},
                                     train={"steps": 30, "lr": 3e-3, "global_batch_size": 8}))
    trainer.fit()
    save_final(trainer, tmp_path / "final")
    gen = Generator.from_pretrained(tmp_path / "final", device="cpu")
    assert gen.stop_ids == sorted([eos, eot])  # the LLM's generation config names id 2, an ordinary word here
    prompts = [Prompt.from_text("Which number comes after six?"), Prompt.from_text("Which is larger, two or one?")]
    batch = collate(gen.process(prompts), gen.processor.pad_id, padding_side="left")
    ids = greedy_token_ids(gen.model, batch, gen.stop_ids, 8, gen.processor.pad_id)
    assert ids.tolist() == [[word, eot], [word, eot]]
    assert gen.generate(prompts, max_new_tokens=8) == ["seven", "seven"]
    longer = greedy_token_ids(gen.model, batch, [eos], 8, gen.processor.pad_id)  # without the turn end: goes on
    assert longer[:, :2].tolist() == [[word, eot], [word, eot]] and longer.shape[1] > 2


def test_generate_names_an_empty_answer_an_empty_prompt_and_a_model_without_video(trained, tmp_path, capsys,
                                                                                   monkeypatch):
    """``plait generate``: an empty answer is marked on stderr (stdout keeps the answer); an empty prompt without
    media is refused; ``--video`` on a model whose job had no video placeholder says so and what to do."""
    from plait.commands.generate import EMPTY_ANSWER, generate_command

    _, final, _, _ = trained
    with pytest.raises(ValueError, match=r"--prompt is empty and no --image/--audio/--video is given"):
        generate_command(final, prompt="  ", device="cpu")
    with pytest.raises(SampleError, match=r"^this model takes no video \(its job had no \[model.encoders.vision.video\] "
                                          r"placeholder that is a token of its tokenizer\): give the frames as --image"):
        generate_command(final, prompt="What?", videos=[str(tmp_path / "clip.mp4")], device="cpu")
    monkeypatch.setattr(Generator, "ask", lambda *args, **kwargs: "")
    assert generate_command(final, prompt="Which digit?", device="cpu") == 0
    out = capsys.readouterr()
    assert out.out == "\n" and out.err.endswith(EMPTY_ANSWER + "\n")  # after any weight-loading bars
    assert out.err.splitlines()[-1] == EMPTY_ANSWER


def test_generate_file_marks_empty_answers_and_counts_them(trained, tmp_path, capsys, monkeypatch):
    """``plait generate --input``: an answer that is a stop token first (here forced on the first row of each batch by
    a bias on the end-of-turn logit) is written as ``"prediction": ""`` with ``"empty": true`` and counted in the
    summary; the other rows keep validation's answers and carry no ``empty`` field."""
    from plait.commands.generate import generate_command
    from plait.models.generation import is_empty_answer

    trainer, final, _, val = trained
    load = Generator.from_pretrained

    def biased(*args, **kwargs):
        gen = load(*args, **kwargs)
        eot = max(gen.stop_ids)  # <|im_end|>

        def first_row_stops(module, inputs, logits):
            logits = logits.clone()
            logits[0, :, eot] += 1e4
            return logits

        gen.model.language_model.lm_head.register_forward_hook(first_row_stops)
        return gen

    monkeypatch.setattr(Generator, "from_pretrained", biased)
    out = tmp_path / "predictions.jsonl"
    assert generate_command(final, input_path=val, output_path=out, batch_size=2, device="cpu",
                            max_new_tokens=trainer.cfg.train.max_new_tokens) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected = trainer_predictions(trainer)
    assert len(rows) == len(expected) == 16
    assert [r["prediction"] for r in rows[0::2]] == [""] * 8 and all(r["empty"] is True for r in rows[0::2])
    assert [r["prediction"] for r in rows[1::2]] == expected[1::2] and not any("empty" in r for r in rows[1::2])
    assert all(p.strip() for p in expected[1::2])  # the unbiased rows really answered
    printed = capsys.readouterr().out.splitlines()
    assert printed[1] == ('plait: 8 of 16 answers empty (no text, nothing but whitespace before the stop token; "empty": '
                          'true in their lines)')
    assert is_empty_answer(" \n") and not is_empty_answer(" 7")
