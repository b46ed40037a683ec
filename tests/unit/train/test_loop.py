"""The step loop every job runs (``plait.train.loop``): what it calls, in which order, and when it writes,
validates, checkpoints and stops, on a recording host."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from plait.data.progress import Progress
from plait.train.loop import LoopSchedule, run_steps, total_steps


class Host:
    """Records every call; loss ``1 / step``; a stop agreed after step ``stop_at``."""

    def __init__(self, start: int = 0, stop_at: int = 0) -> None:
        self.step, self.stop_at, self.calls = start, stop_at, []

    def before_step(self, step):
        self.calls.append(("before", step))

    def next_step(self):
        self.step += 1
        self.calls.append(("step", self.step))
        return {"step": self.step, "loss": 1.0 / self.step, "tokens_per_s": 10.0}

    def validate(self, step):
        self.calls.append(("validate", step))
        return {"step": step, "eval": {"task": step / 10}}

    def write(self, row):
        self.calls.append(("write", row["step"], "eval" in row))

    def stop_agreed(self):
        return signal.SIGTERM if self.step == self.stop_at else 0

    def checkpoint(self, step):
        self.calls.append(("checkpoint", step))

    def say(self, message):
        self.calls.append(("say", message))


def test_the_loop_writes_validates_and_checkpoints_on_schedule():
    host = Host()
    when = LoopSchedule(total=5, end=5, log_every=2, eval_every=2, checkpoint_every=3, validates=True)
    done = run_steps(host, when, 0, Progress(5, "t", enabled=False))
    assert (done.step, done.losses, done.evals, done.stopped) == (5, [1.0, 0.5, 1 / 3, 0.25, 0.2], {"task": 0.5}, 0)
    assert host.calls == [
        ("before", 0), ("step", 1),
        ("before", 1), ("step", 2), ("write", 2, False), ("validate", 2), ("write", 2, True),
        ("say", "step 2: validation exact match task=20.0%"),
        ("before", 2), ("step", 3), ("checkpoint", 3),
        ("before", 3), ("step", 4), ("write", 4, False), ("validate", 4), ("write", 4, True),
        ("say", "step 4: validation exact match task=40.0%"),
        ("before", 4), ("step", 5), ("write", 5, False), ("validate", 5), ("write", 5, True),
        ("say", "step 5: validation exact match task=50.0%"), ("checkpoint", 5)]


def test_a_stop_ends_the_loop_after_a_checkpoint_and_a_resumed_run_stops_at_its_end():
    host = Host(start=3, stop_at=5)
    done = run_steps(host, LoopSchedule(total=10, end=10), 3, Progress(10, "t", enabled=False))
    assert (done.step, done.stopped) == (5, signal.SIGTERM)
    assert [c for c in host.calls if c[0] in ("step", "checkpoint")] == [("step", 4), ("step", 5), ("checkpoint", 5)]
    # stop_after: a run ending before the job's last step checkpoints there and does not validate
    host = Host()
    done = run_steps(host, LoopSchedule(total=10, end=2, validates=True), 0, Progress(10, "t", enabled=False))
    assert done.step == 2 and ("checkpoint", 2) in host.calls and not any(c[0] == "validate" for c in host.calls)


def test_the_jobs_steps_come_from_steps_or_epochs():
    def job(steps, epochs):
        return SimpleNamespace(train=SimpleNamespace(steps=steps, epochs=epochs))

    assert total_steps(job(7, 3), 5) == 7
    assert total_steps(job(0, 1.5), 5) == 8  # 7.5 batches, rounded up
