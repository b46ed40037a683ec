"""Workers of tests/distributed/test_resilience.py: two heterogeneous pipelines (workers 0+1: 2 ranks; worker 2:
1 rank) train a tiny MLLM with f = 1. Worker 0 (rank 0) is SIGKILLed at the start of step 1: the survivors detect
it, re-form their group (plait.parallel.membership), plan the reconfiguration (plait.planner.resilience.reconfigure: pipeline
0 shrinks to the 1-rank template), worker 1 receives the units it lacks (parameters and AdamW state) from worker 2
(plait.parallel.unit_transfer), and the step is replayed from its start. Worker 2 (the other pipeline) is
SIGKILLed at the start of step 2 and worker 1 goes on alone. Every committed step's loss, gradients and the final
parameters equal one process training the same global batches."""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.models.units import model_units
from plait.parallel.grad_sync import HeteroSync
from plait.parallel.hetero_dp import HeteroDP, build_hetero_dp, hetero_pipeline_comm
from plait.parallel.membership import Membership
from plait.parallel.pipeline import run_pipeline_step
from plait.parallel.stages import RankStages, build_rank_stages
from plait.parallel.unit_transfer import move_units, unit_parameter_names
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.resilience.reconfigure import plan_reconfiguration
from plait.planner.resilience.types import Instantiation, PipelineTemplate, TemplateSet, Transfer, UnitBytes
from plait.planner.pipeline.schedule_ir import Schedule
from plait.planner.pipeline.schedules import build_schedule
from plait.planner.resilience.templates import instantiate
from plait.train.loss import token_loss_sum
from tests.distributed.pipeline_worker import _check_grads, _close, apply_mode, make_batch, reference_step, tiny_model

STEPS = (("iva", "t", "i"), ("a", "ia", "t"), ("t", "i", "a"), ("ia", "a", "i"))
VICTIMS = {0: 1, 2: 2}  # worker id -> the step at whose start it is killed
TIMEOUT_S = 8.0
DEAD_AFTER_S = 6.0
"""A member is dead when its heartbeat is this old (a SIGKILLed worker's stops at once). Not the default 1.5 s: on a
loaded 2-core machine (load average 4) a live worker's heartbeat thread was starved that long, and the survivors
took it for dead (NoQuorumError)."""
PLANS = {  # template size -> (layout, stages per module, plan rank per stage)
    2: ("encoder_parallel", {"vision": 2, "audio": 1, "llm": 2}, (0, 1, 0, 1, 0)),
    1: ("encoders_colocated", {"vision": 1, "audio": 1, "llm": 1}, (0, 0)),
}
ADAMW_STATE = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(1), "exp_avg_sq": torch.zeros(1)}


def _model():
    return apply_mode(tiny_model(tied=True), "all")


def template_set() -> TemplateSet:
    """Templates of 1 and 2 ranks for 3 workers, f = 1 (times made up: the 2-rank pipeline twice as fast)."""
    units = model_units(_model())
    plans = {n: plan_pipeline(units, lay, stages_per_module=per, ranks=ranks) for n, (lay, per, ranks) in PLANS.items()}
    templates = (PipelineTemplate(1, plans[1], "1f1b", 0.0, 2.0, (0.0,)),
                 PipelineTemplate(2, plans[2], "1f1b", 0.5, 1.0, (0.0, 0.0)))
    return TemplateSet(3, 1, 3, templates, tuple(UnitBytes(u.name, 0, 0) for u in units))


@dataclass
class Run:
    """This worker's part of an instantiation: stages, groups, schedule, optimizer and its microbatches."""

    stages: RankStages
    hetero: HeteroDP
    schedule: Schedule
    opt: torch.optim.Optimizer
    first: int
    count: int


def build_run(inst: Instantiation, wid: int, members: tuple[int, ...], old: Run | None,
              transfers: tuple[Transfer, ...] = ()) -> Run:
    """Build this worker's stages for ``inst`` on a fresh model, then fill them from ``old`` and the transfers."""
    rank_of = {w: i for i, w in enumerate(members)}
    index = inst.pipeline_of(wid)
    pipeline = inst.pipelines[index]
    comm = hetero_pipeline_comm([[rank_of[w] for w in p.ranks] for p in inst.pipelines], rank_of[wid])
    model = _model()
    names = unit_parameter_names(model)
    stages = build_rank_stages(model, pipeline.template.plan, comm.pp_rank)
    params = [p for _, p in stages.trainable_parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    if old is not None:
        held = {n: (p, old.opt.state.get(p, {})) for n, p in old.stages.model.named_parameters(remove_duplicate=False)}
        new = dict(stages.model.named_parameters(remove_duplicate=False))
        state = move_units(held, new, names, transfers, wid, rank_of, ADAMW_STATE)
        for fqn, values in state.items():
            if values and new[fqn].requires_grad:
                opt.state[new[fqn]] = values
    hetero = build_hetero_dp(stages, comm, datetime.timedelta(seconds=TIMEOUT_S))
    schedule = build_schedule(pipeline.template.plan, "1f1b", pipeline.microbatches)
    first = sum(p.microbatches for p in inst.pipelines[:index])
    return Run(stages, hetero, schedule, opt, first, pipeline.microbatches)


def worker(wid: int, world: int, port: int) -> None:
    """One worker (``wid``: its rank in generation 0)."""
    torch.set_num_threads(1)
    m = Membership("127.0.0.1", port, wid, world, timeout_s=TIMEOUT_S, dead_after_s=DEAD_AFTER_S)
    m.join()
    ts = template_set()
    inst = instantiate(ts, [[0, 1], [2]])
    assert [p.microbatches for p in inst.pipelines] == [2, 1]
    ref = _model()
    ref_opt = torch.optim.AdamW([p for _, p in ref.trainable_parameters()], lr=1e-2)
    run = build_run(inst, wid, m.members, None)
    seen = {"losses": [], "recovery_s": [], "pipelines": [], "copies": []}
    step, failed_at = 0, None
    while step < len(STEPS):
        batches = [make_batch(k, 100 * step + i) for i, k in enumerate(STEPS[step])]
        if VICTIMS.get(wid) == step:
            os.kill(os.getpid(), signal.SIGKILL)  # in the middle of the job, before its step's first message
        targets = sum(b.target_tokens for b in batches)
        try:
            res = run_pipeline_step(run.stages, run.schedule, batches[run.first:run.first + run.count], targets,
                                    run.hetero.comm, loss_fn=token_loss_sum, sync=HeteroSync(run.hetero))
        except RuntimeError:  # a peer died: re-form, reconfigure, copy state, replay this step
            failed_at = failed_at or time.monotonic()
            left = m.reform()
            rec = plan_reconfiguration(ts, inst, left)
            run = build_run(rec.after, wid, m.members, run, rec.transfers)
            inst = rec.after
            seen["pipelines"].append([list(p.ranks) for p in inst.pipelines])
            seen["copies"].append([[t.unit, t.src, t.dst] for t in rec.transfers])
            continue
        where = f"step {step} worker {wid}"
        _close(res.loss, reference_step(ref, batches), f"{where}: loss")
        _check_grads(run.stages, ref, where)
        for o in (run.opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
        if failed_at is not None:
            seen["recovery_s"].append(time.monotonic() - failed_at)
            failed_at = None
        seen["losses"].append(res.loss)
        step += 1
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, param in run.stages.model.named_parameters():
        if "k_proj.bias" not in name:  # 0 gradient up to rounding: AdamW makes noise +-lr steps (hetero_dp_worker)
            torch.testing.assert_close(param, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda t: f"{name}: {t}")
    m.close()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    store.set(f"result/{wid}", json.dumps(seen))
