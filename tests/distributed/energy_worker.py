"""Energy plans in the pipeline runtime on gloo (spawned by tests/distributed/test_energy.py).

- ``worker_identical`` (PP=2): the same model trained twice in step, once with a recording frequency controller and
  once without: every action's event carries exactly the planned frequency (in schedule order) and losses and
  parameters are bit-equal.
- ``worker_straggler`` (DP=2 x PP=2): replica 1 sleeps inside its steps 2-5; replica 0 switches to the frontier
  point at the straggler's time after ``patience`` slow steps and back after ``patience`` recovered ones.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from plait.models.units import model_units
from plait.parallel.energy import FrequencyController, StragglerReaction, step_span_s
from plait.parallel.pipeline import build_pipeline_comm, run_pipeline_step
from plait.parallel.stages import build_rank_stages
from plait.planner.energy.types import ActionFrequency, EnergyPlan, FrontierPoint, action_label
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.schedules import build_schedule
from plait.planner.resilience.types import StragglerPolicy
from plait.train.loss import token_loss_sum
from tests.distributed.pipeline_worker import make_batch, tiny_model
from tests.distributed.spawning import gloo_group

LAYOUT = dict(layout="encoders_colocated", stages_per_module={"vision": 1, "audio": 1, "llm": 1}, ranks=(0, 1))
MAX_MHZ = 1980


def planned_frequencies(schedule, step_mhz: int) -> tuple[ActionFrequency, ...]:
    """A distinct frequency per action of every rank (every third action left out: it runs at the max)."""
    out = []
    for rank, actions in enumerate(schedule.actions):
        for i, a in enumerate(actions):
            if i % 3 != 2:
                mhz = step_mhz + 100 * "FBW".index(a.kind) + 10 * a.stage + a.microbatch + 200 * rank
                out.append(ActionFrequency(rank, action_label(a.kind, a.stage, a.microbatch), mhz))
    return tuple(out)


def energy_plan(schedule, times=(1.0,)) -> EnergyPlan:
    """One frontier point per time, slower points at lower frequencies and energies."""
    points = tuple(FrontierPoint(t, 500.0 - 50 * i, planned_frequencies(schedule, 1400 - 300 * i))
                   for i, t in enumerate(times))
    return EnergyPlan("test-gpu", MAX_MHZ, points)


def _setup(world: int, port: int, options: dict, microbatches: int):
    comm = build_pipeline_comm(2)
    model = tiny_model()
    plan = plan_pipeline(model_units(model), **LAYOUT)
    schedule = build_schedule(plan, "1f1b", microbatches, **options)
    return comm, model, plan, schedule


def worker_identical(rank: int, world: int, port: int) -> None:
    """PP=2: with and without a frequency plan, the same training; the plan's frequency before every action."""
    with gloo_group(rank, world, port):
        comm, model, plan, schedule = _setup(world, port, {"split_backward": True}, 3)
        other = copy.deepcopy(model)
        runs = [build_rank_stages(model, plan, comm.pp_rank), build_rank_stages(other, plan, comm.pp_rank)]
        opts = [torch.optim.AdamW([p for _, p in s.trainable_parameters()], lr=1e-2) for s in runs]
        eplan = energy_plan(schedule)
        controller = FrequencyController(eplan, comm.pp_rank)
        for step, kinds in enumerate((("iva", "t", "i"), ("a", "ia", "t"), ("i", "t", "iva"))):
            batches = [make_batch(k, 100 * step + i) for i, k in enumerate(kinds)]
            targets = sum(b.target_tokens for b in batches)
            results = [run_pipeline_step(stages, schedule, batches, targets, comm, loss_fn=token_loss_sum,
                                         frequency=ctl) for stages, ctl in zip(runs, (controller, None))]
            assert results[0].loss == results[1].loss, (step, results[0].loss, results[1].loss)
            mine = schedule.actions[comm.pp_rank]
            labels = [action_label(a.kind, a.stage, a.microbatch) for a in mine]
            got = [(action_label(e.kind, e.stage, e.microbatch), e.frequency_mhz) for e in results[0].events]
            want = [(lab, eplan.frequency_of(eplan.points[0], comm.pp_rank, lab)) for lab in labels]
            assert got == want, (step, got, want)
            assert controller.records[-len(mine):] == want
            assert {e.frequency_mhz for e in results[1].events} == {0}
            assert MAX_MHZ in {f for _, f in want} and len({f for _, f in want}) > 2
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
        for (name, a), (_, b) in zip(runs[0].trainable_parameters(), runs[1].trainable_parameters()):
            assert torch.equal(a, b), name


class SleepyController(FrequencyController):
    """A recording controller that sleeps ``delay_s`` before each action while ``slow`` (an injected straggler)."""

    slow = False
    delay_s = 0.5

    def before(self, kind: str, stage: int, microbatch: int) -> int:
        if self.slow:
            time.sleep(self.delay_s)
        return super().before(kind, stage, microbatch)


SLOW_STEPS = range(2, 6)
STEPS = 12


def worker_straggler(rank: int, world: int, port: int, out: str) -> None:
    """DP=2 x PP=2: replica 1 is slow in ``SLOW_STEPS``; rank 0 writes to the JSON file ``out``, per rank, the
    frontier point index each step ran (from the recorded frequencies) and the reaction's history."""
    with gloo_group(rank, world, port, timeout_s=120):
        comm, model, plan, schedule = _setup(world, port, {}, 2)
        stages = build_rank_stages(model, plan, comm.pp_rank)
        # close times: recording on CPU does not slow replica 0 down, so its time relative to its point's drops by
        # 1 / 1.25 at most; thresholds far above the timing noise of a shared 2-core machine (a slow step is ~30x)
        eplan = energy_plan(schedule, times=(1.0, 1.1, 1.25))
        controller = SleepyController(eplan, comm.pp_rank)
        reaction = StragglerReaction(controller, StragglerPolicy(slow_ratio=5.0, recover_ratio=3.0, patience=2),
                                     comm.dp_rank, comm.dp_size, torch.device("cpu"))
        per_step, spans = [], []
        for step in range(STEPS):
            kinds = ("iva", "t", "a", "i")
            batches = [make_batch(k, 100 * step + i) for i, k in enumerate(kinds)]
            controller.slow = comm.dp_rank == 1 and step in SLOW_STEPS
            res = run_pipeline_step(stages, schedule, batches[2 * comm.dp_rank: 2 * comm.dp_rank + 2],
                                    sum(b.target_tokens for b in batches), comm, loss_fn=token_loss_sum,
                                    frequency=controller)
            per_step.append(tuple(e.frequency_mhz for e in res.events))
            spans.append(round(step_span_s(res.events), 3))
            reaction.observe(spans[-1])
        # the frequencies of each point on this rank, to name the point each step ran
        names = {}
        for i, point in enumerate(eplan.points):
            names[tuple(eplan.frequency_of(point, comm.pp_rank, action_label(a.kind, a.stage, a.microbatch))
                        for a in schedule.actions[comm.pp_rank])] = i
        gathered = [None] * world
        dist.all_gather_object(gathered, (comm.dp_rank, comm.pp_rank, [names.get(f, -1) for f in per_step],
                                          reaction.history, spans))
        if rank == 0:
            Path(out).write_text(json.dumps([{"dp": d, "pp": p, "points": pts, "history": h, "spans_s": sp}
                                             for d, p, pts, h, sp in gathered]))
