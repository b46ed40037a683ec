"""Trainer invariants: loss normalisation under gradient accumulation, freezing, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.train.optim import build_scheduler
from plait.train.trainer import Trainer
from tests.helpers.jobs import demo_records


def mixed_records():
    """Four samples with very different numbers of target tokens (1-word to 7-word answers)."""
    recs = demo_records("train", ("image_digit",), limit=1) + demo_records("train", ("audio_transcribe",), limit=1)
    long = dict(recs[0], id="long", messages=[recs[0]["messages"][0],
                {"role": "assistant", "content": "seven seven seven one two three four five six"}])
    text = demo_records("train", ("text",), limit=1)
    return recs + [long] + text


def grads_after(trainer: Trainer, indices):
    loss, targets = trainer.forward_backward(indices)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    return loss, targets, grads


def test_gradient_accumulation_invariance(tiny_job):
    recs = mixed_records()
    results = []
    for mbs in (1, 4, 3):
        cfg = tiny_job(recs, train={"microbatch_size": mbs, "global_batch_size": 4})
        results.append(grads_after(Trainer.build(cfg), [0, 1, 2, 3]))
    (l1, t1, g1), (l4, t4, g4), (l3, _, g3) = results
    counts = [s.meta.target_tokens for s in Trainer.build(tiny_job(recs)).train_set.samples]
    assert max(counts) >= 4 * min(counts)  # very different target counts
    assert t1 == t4 == sum(counts)
    assert l1 == pytest.approx(l4, rel=1e-6) and l3 == pytest.approx(l4, rel=1e-6)
    assert set(g1) == set(g4) and len(g1) > 10
    for name in g4:
        torch.testing.assert_close(g1[name], g4[name], rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(g3[name], g4[name], rtol=1e-5, atol=1e-7, msg=name)


def test_loss_is_mean_over_global_target_tokens_not_mean_of_microbatch_means(tiny_job):
    recs = mixed_records()
    trainer = Trainer.build(tiny_job(recs, train={"microbatch_size": 1, "global_batch_size": 4}))
    per_sample = []
    for i in range(4):
        loss, targets = trainer.forward_backward([i])
        per_sample.append((loss * targets, targets))
        trainer.optimizer.zero_grad()
    loss, _ = trainer.forward_backward([0, 1, 2, 3])
    expected = sum(s for s, _ in per_sample) / sum(t for _, t in per_sample)
    assert loss == pytest.approx(expected, rel=1e-6)
    assert loss != pytest.approx(sum(s / t for s, t in per_sample) / 4, rel=1e-3)


def test_frozen_parts_stay_bit_identical_and_unfrozen_parts_all_train(tiny_job):
    recs = demo_records("train", ("image_audio",), limit=4)
    cfg = tiny_job(recs)
    cfg.model.encoders["vision"].freeze = True
    cfg.model.encoders["audio"].freeze_projector = True
    cfg.model.llm.freeze = True
    trainer = Trainer.build(cfg)
    model = trainer.model
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(n.startswith(("encoders.vision.projector", "encoders.audio.encoder")) for n in trainable)
    assert any(n.startswith("language_model") for n in frozen)
    opt_params = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(p) for _, p in model.trainable_parameters()}
    for _ in range(2):
        trainer.train_step([0, 1, 2, 3])
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
        else:
            assert not torch.equal(p, trainable[n]), f"{n} did not change"


def test_warmup_then_cosine_schedule():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, warmup=4, total=12, min_ratio=0.1)
    lrs = []
    for _ in range(13):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[8] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the cosine
    assert lrs[12] == pytest.approx(0.1)


def test_resume_mid_epoch_in_second_epoch_reproduces_the_run(tiny_job, tmp_path):
    recs = demo_records("train", limit=10)  # 10 samples, batch 4: 3 batches per epoch, last one of 2
    sections = dict(train={"steps": 7, "global_batch_size": 4, "microbatch_size": 2},
                    checkpoint={"every": 4, "keep": 3})
    full = Trainer.build(tiny_job(recs, **sections)).fit()
    assert len(full["losses"]) == 7

    sections["metrics"] = {"run_dir": str(tmp_path / "run2")}
    first = Trainer.build(tiny_job(recs, **sections))
    part = first.fit(stop_after=4)  # stops after step 4: epoch 1, batch 1 (mid-epoch, second epoch)
    assert first.loader.epoch == 1 and first.loader.batch_in_epoch == 1
    assert part["losses"] == full["losses"][:4]

    second = Trainer.build(tiny_job(recs, **sections))
    rest = second.fit(resume=True)
    assert rest["losses"] == full["losses"][4:]  # exactly, not approximately
    steps = [json.loads(line)["step"] for line in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, 8))


def test_hierarchical_microbatches_train_like_arrival_order(tiny_job):
    """Same global batches, different grouping: the loss normalisation makes steps identical (fp32).

    Parameters are compared where the gradient is not zero in exact arithmetic: for a key bias (softmax is
    invariant to it) both runs get rounding noise of ~1e-10, which AdamW scales up to full-size steps.
    """
    recs = (demo_records("train", ("image_digit",), limit=3) + demo_records("train", ("audio_transcribe",), limit=3)
            + demo_records("train", ("text",), limit=2))
    runs = {}
    batch = list(range(8))
    for policy in ("arrival", "hierarchical"):
        trainer = Trainer.build(tiny_job(recs, train={"steps": 3, "global_batch_size": 8, "microbatch_size": 2,
                                               "microbatch_policy": policy}))
        groups = trainer.microbatches(batch)
        _, _, grads = grads_after(trainer, batch)
        losses = [trainer.train_step(batch).loss for _ in range(3)]
        runs[policy] = (groups, grads, losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    (g_a, d_a, l_a, p_a), (g_h, d_h, l_h, p_h) = runs["arrival"], runs["hierarchical"]
    assert g_a == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g_h != g_a and sorted(i for g in g_h for i in g) == batch
    assert l_h == pytest.approx(l_a, rel=1e-5)
    assert set(d_a) == set(d_h)
    for name, grad in d_a.items():
        torch.testing.assert_close(d_h[name], grad, rtol=1e-5, atol=1e-8, msg=name)
    compared = 0
    for name, value in p_a.items():
        if name in d_a and d_a[name].abs().max() > 1e-6:
            torch.testing.assert_close(p_h[name], value, rtol=1e-5, atol=1e-6, msg=name)
            compared += 1
    assert compared > 0.8 * len(d_a)


def test_step_metrics_report_microbatch_balance(tiny_job):
    recs = demo_records("train", ("image_digit", "audio_transcribe"), limit=8)
    trainer = Trainer.build(tiny_job(recs, train={"global_batch_size": 8, "microbatch_size": 2}))
    res = trainer.train_step(list(range(8)))
    assert set(res.workload) == {"vision", "audio", "llm"}
    for stats in res.workload.values():
        assert stats["cv"] >= 0 and stats["max_over_mean"] >= 1.0


def _loss_steps(run_dir) -> list[int]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in lines if "loss" in r]


def test_new_run_into_an_old_run_dir_removes_its_checkpoints(tiny_job, caplog, recwarn):
    """Run A saves steps 2, 4, 6; a fresh run B (2 steps) into the same folder removes them, so a later resume
    continues B (from its step 2), not A (from step 6); re-saving a step on resume raises no torch warning."""
    import logging
    import warnings

    recs = demo_records("train", ("text",), limit=4)
    sections = dict(train={"steps": 6, "global_batch_size": 2, "microbatch_size": 2},
                    checkpoint={"every": 2, "keep": 5})
    Trainer.build(tiny_job(recs, **sections)).fit()
    run_dir = Path(tiny_job(recs).metrics.run_dir)
    names = lambda: sorted(p.name for p in (run_dir / "checkpoints").iterdir())  # noqa: E731
    assert names() == ["step_000002", "step_000004", "step_000006"]
    sections["train"]["steps"] = 2
    warnings.simplefilter("always")
    with caplog.at_level(logging.WARNING):
        Trainer.build(tiny_job(recs, **sections)).fit(overwrite=True)  # issue 12: refused without it
    assert any("already holds checkpoints of an earlier run: removed its 3 checkpoint(s) (newest step_000006)"
               in r.message for r in caplog.records)
    assert names() == ["step_000002"]
    sections["train"]["steps"] = 4
    assert Trainer.build(tiny_job(recs, **sections)).fit(resume=True)["steps"] == 2  # B's step 2 -> 4
    assert _loss_steps(run_dir) == [1, 2, 3, 4] and names() == ["step_000002", "step_000004"]
    Trainer.build(tiny_job(recs, **sections)).fit(resume=str(run_dir / "checkpoints" / "step_000002"))  # re-saves step 4
    assert not [w for w in recwarn if "existing checkpoint" in str(w.message)]


def test_resume_with_nothing_left_says_so_and_reports_no_steps_trained(tiny_job, caplog):
    import logging

    recs = demo_records("train", ("text",), limit=4)
    cfg = tiny_job(recs, train={"steps": 1})
    assert Trainer.build(cfg).fit()["steps"] == 1
    with caplog.at_level(logging.WARNING):
        result = Trainer.build(cfg).fit(resume=True)
    assert any("nothing to train: checkpoint is at step 1, train.steps = 1" in r.message for r in caplog.records)
    assert result["steps"] == 0 and result["step"] == 1 and result["losses"] == []


def test_progress_in_a_log_is_plain_lines_not_carriage_returns(tiny_job, capsys):
    """stderr captured by pytest is not a TTY, like a log file: first and last step as plain lines."""
    recs = demo_records("train", ("text",), limit=4)
    Trainer.build(tiny_job(recs, train={"steps": 3, "global_batch_size": 2}, metrics={"progress": True})).fit()
    err = capsys.readouterr().err
    assert "\r" not in err
    assert [line.split(",")[0] for line in err.splitlines() if line.startswith("train: step")] == [
        "train: step 1/3", "train: step 3/3"]


def test_validation_progress_counts_each_sample_once_per_pass(tiny_job, capsys):
    recs, val = demo_records("train", ("text",), limit=4), demo_records("val", ("text",), limit=3)
    Trainer.build(tiny_job(recs, val, train={"steps": 1, "global_batch_size": 2, "max_new_tokens": 2},
                           metrics={"progress": True})).fit()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("validation step 1")]
    assert lines[-2:] == ["validation step 1: loss: sample 3/3", "validation step 1: answers: sample 3/3"]


def test_resume_is_exact_when_a_branch_had_no_gradient_yet(tiny_job, tmp_path):
    """Step 1 is text-only (the vision branch has no optimizer state when step 1 is saved), steps 2-3 have images:
    the step-3 loss shows whether the vision branch's first update after resume matched."""
    recs = demo_records("train", ("text",), limit=4) + demo_records("train", ("image_digit",), limit=8)
    sections = dict(data={"shuffle": False}, train={"steps": 3, "global_batch_size": 4, "microbatch_size": 2},
                    checkpoint={"every": 1, "keep": 3})
    full = Trainer.build(tiny_job(recs, **sections)).fit()
    sections["metrics"] = {"run_dir": str(tmp_path / "run2")}
    Trainer.build(tiny_job(recs, **sections)).fit(stop_after=1)
    resumed = Trainer.build(tiny_job(recs, **sections))
    rest = resumed.fit(resume=str(tmp_path / "run2" / "checkpoints" / "step_000001"))
    assert rest["losses"] == full["losses"][1:]


def test_generation_stops_on_eos_and_the_chat_templates_turn_end():
    from transformers import AutoTokenizer

    from plait.models.generation import stop_token_ids
    from tests.helpers.jobs import DEMO

    tok = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    assert stop_token_ids(tok) == sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}) == [2, 4]


def test_resume_past_a_shorter_train_steps_does_not_announce_a_re_stretched_cosine(tiny_job, capsys):
    recs = demo_records("train", ("text",), limit=4)
    cfg = tiny_job(recs, train={"steps": 3, "global_batch_size": 2}, checkpoint={"every": 1, "keep": 3})
    Trainer.build(cfg).fit()
    capsys.readouterr()
    shorter = tiny_job(recs, train={"steps": 2, "global_batch_size": 2}, checkpoint={"every": 1, "keep": 3})
    assert Trainer.build(shorter).fit(resume=True)["steps"] == 0
    out = capsys.readouterr().out
    assert "resuming step 3" in out and "re-stretched" not in out
