"""Plain range checks of the config loader (``plait.config.loader.validate``), named by dotted key with the range
and the value, and the "did you mean" of unknown keys: all before anything heavy is imported (``plait.cli`` reads
the job first), not seconds later in the trainer or the data pipeline."""

from __future__ import annotations

import subprocess
import sys

import pytest

from plait.config.loader import load_config
from tests.helpers.jobs import ROOT

DEMO = ROOT / "configs" / "demo.toml"


@pytest.mark.parametrize("override, message", [
    ("--model.encoders.vision.video.fps=-1", "model.encoders.vision.video.fps must be >= 0 (0: every frame), got -1.0"),
    ("--model.encoders.vision.video.fps=inf", "model.encoders.vision.video.fps must be >= 0 (0: every frame), got inf"),
    ("--model.encoders.audio.video.max_frames=0", "model.encoders.audio.video.max_frames must be >= 1, got 0"),
    ("--parallel.dp=-1", "parallel.dp must be >= 0 (0: world size / (dp_shard x pp x cp x tp)), got -1"),
    ("--parallel.cp=0", "parallel.cp must be >= 1 (1: no context parallelism), got 0"),
    ("--parallel.timeout_s=0", "parallel.timeout_s must be a positive number of seconds, got 0.0"),
    ("--train.warmup_steps=-5", "train.warmup_steps must be >= 0, got -5"),
    ("--train.weight_decay=-0.01", "train.weight_decay must be >= 0 (0: no weight decay), got -0.01"),
    ("--train.betas=[0.9, 1.0]", "train.betas must both be in [0, 1) (AdamW's), got [0.9, 1.0]"),
    ("--train.betas=[-0.1, 0.95]", "train.betas must both be in [0, 1) (AdamW's), got [-0.1, 0.95]"),
    ("--train.grad_clip=-1", "train.grad_clip must be >= 0 (0: no clipping), got -1.0"),
    ("--train.eval_every=-1", "train.eval_every must be >= 0 (0: only at the end), got -1"),
    ("--train.max_new_tokens=0", "train.max_new_tokens must be >= 1, got 0"),
    ("--train.eval_batch_size=-2", "train.eval_batch_size must be >= 0 (0: max(train.microbatch_size, 16)), got -2"),
    ("--data.val_max_samples=0", "data.val_max_samples must be >= 1 (leave it unset for every validation record; "
                                 "no data.val for none), got 0"),
    ("--checkpoint.every=-1", "checkpoint.every must be >= 0 (0: only at the end), got -1"),
    ("--checkpoint.keep=-1", "checkpoint.keep must be >= 0 (0: keep all), got -1"),
    ("--metrics.log_every=0", "metrics.log_every must be >= 1 (a row every N steps), got 0"),
])
def test_out_of_range_values_are_refused_naming_the_field(override, message):
    with pytest.raises(ValueError) as refused:
        load_config(DEMO, [override])
    assert str(refused.value) == message


def test_the_edges_of_each_range_are_accepted():
    cfg = load_config(DEMO, ["--model.encoders.vision.video.fps=0", "--model.encoders.vision.video.max_frames=1",
                             "--parallel.dp=0", "--train.warmup_steps=0", "--train.weight_decay=0",
                             "--train.betas=[0.0, 0.999]", "--train.grad_clip=0", "--train.max_new_tokens=1",
                             "--data.val_max_samples=1", "--checkpoint.keep=0", "--metrics.log_every=1"])
    assert (cfg.model.encoders["vision"].video.fps, cfg.train.betas, cfg.data.val_max_samples) == (0.0, (0.0, 0.999), 1)


@pytest.mark.parametrize("override, message", [
    ("--train.lrr=1", "unknown config key(s) ['train.lrr'] (did you mean train.lr?); known: ['activation_checkpointing'"),
    ("--trian.lr=1", "unknown config key(s) ['trian'] (did you mean train?); known: ['attention', 'checkpoint', 'data', "
                     "'energy', 'metrics', 'model', 'parallel', 'train']"),
    ("--parallel.pp.degre=2", "unknown config key(s) ['parallel.pp.degre'] (did you mean parallel.pp.degree?); known: "),
    ("--model.encoders.vision.video.fsp=2", "unknown config key(s) ['model.encoders.vision.video.fsp'] (did you mean "
                                            "model.encoders.vision.video.fps?); known: ['audio', 'fps', 'max_frames', "
                                            "'placeholder']"),
    ("--train.bogus=1", "unknown config key(s) ['train.bogus']; known: ['activation_checkpointing'"),
])
def test_unknown_keys_suggest_close_matches(override, message):
    with pytest.raises(ValueError) as refused:
        load_config(DEMO, [override])
    assert str(refused.value).startswith(message)


def test_several_unknown_keys_each_get_their_suggestion():
    with pytest.raises(ValueError) as refused:
        load_config(DEMO, ["--train.lrr=1", "--train.sedd=2", "--train.bogus=3"])
    assert str(refused.value).startswith("unknown config key(s) ['train.bogus', 'train.lrr', 'train.sedd'] "
                                         "(train.lrr: did you mean train.lr?; train.sedd: did you mean train.seed?); "
                                         "known: ['activation_checkpointing', ")


def test_a_range_error_is_reported_before_torch_is_imported():
    """``plait train`` with a negative video fps exits 2 with the one line, having imported neither torch nor
    transformers (the check used to come from ``plait.data.video`` after the model was built)."""
    script = ("import sys; from plait.cli import main; code = main(['train', '--config', sys.argv[1], "
              "'--model.encoders.vision.video.fps=-1']); "
              "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", script, str(DEMO)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert run.stdout.split() == ["2", "False", "False"], run.stderr[-2000:]
    assert run.stderr == "plait: error: model.encoders.vision.video.fps must be >= 0 (0: every frame), got -1.0\n"
