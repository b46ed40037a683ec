"""Goodput at cluster scale: the effective training time ratio (ETTR = productive training time / wall time) of
1,024, 4,096 and 16,384 GPUs (8 per node; a failure takes a whole node, the failure domain) under failure rates
from published cluster studies, for plait's recovery, checkpoint-restart and torchft-style fixed replicas.

Failure rates (per GPU-hour; ``--rates`` picks, ``--per-gpu-rate`` overrides):

- ``llama3`` (default): Meta, "The Llama 3 Herd of Models" (2024), section 3.3.4: 419 unexpected interruptions in a
  54-day snapshot of pre-training on 16,384 H100 GPUs (about 78% attributed to hardware):
  419 / (54 d * 24 h * 16384 GPUs) = 1.97e-5 per GPU-hour (7.76 failures a day at 16,384 GPUs).
- ``rsc1-node-days``: Kokolis et al., "Revisiting Reliability in Large-Scale ML Research Clusters" (Meta,
  2024/2025): 5.0-6.5 failures per 1000 node-days on RSC-1; the upper end, 6.5 / 1000 / 24 h / 8 GPUs = 3.4e-5.
- ``rsc1-1024-mttf``: the same paper's mean time to failure of about 7.9 h for 1024-GPU jobs on RSC-1:
  1 / (7.9 h * 1024) = 1.24e-4 per GPU-hour.
- The target, 97% ETTR, is ByteRobust's (ByteDance, 2025): 97% over 3 months on 9,600 GPUs.

Failures are Poisson per node (rate 8 x the per-GPU rate), ``--failures`` of them simulated per size (event-driven,
seeded; a failure arriving during a recovery is taken when it ends). Strategies:

- **plait**: detection + agreement + process-group re-forming (``plait.parallel.membership``, measured below) +
  copying the lost units from surviving replicas (the largest bytes one rank receives / ``--copy-gbps``), the
  interrupted step replayed, no checkpoint read; the job runs without the node (a throughput share lost) until it
  rejoins ``--spare-s`` later, which stalls the job for re-forming + copying the joiners their units. A checkpoint
  reload is needed only when a unit loses its f + 1 copies (f = 1, copies on 2 nodes: two failures in one recovery
  window, not modelled: about 1e-6 of failures at 16k) or when node 0 fails (it hosts the membership store, the one
  trusted process: docs/resilience.md), so plait checkpoints at Young's interval for that node's MTBF.
- **restart**: checkpoint-restart (``bench/resilience.py``'s ``ckpt_plan`` and ``restart_cost``): a checkpoint at
  Young's interval ``sqrt(2 * write_s * MTBF)`` (rounded to whole steps), the work since the last one lost on a
  failure, ``--restart-s`` + reading the checkpoint; the job restarts on a spare node at full size.
- **fixed** (torchft-style): replicas of the best homogeneous plan; a failure stalls the job for detection,
  agreement and re-forming (plait's measured components: an assumption for torchft's lighthouse quorum), the
  interrupted step is replayed, and the replica group that lost the node drops out until a spare arrives
  (``--spare-s``) and heals from a peer (re-forming stall); node 0 (its lighthouse) as plait's store.

Every strategy writes checkpoints at ``--ckpt-gbps`` per GPU (one copy of the state, written by all GPUs, as in
bench/resilience.py; no file-system bandwidth cap, so writes at 16k GPUs take milliseconds, which favours restart). The representative job (``--model``, default VLM-M of bench/pipeline_plans.py, every part
training, H100 costs) is planned by plait at ``--plan-gpus`` (32) GPUs with ``--microbatches-per-gpu`` (2): its
iteration time, model state, the bytes copied after losing node 1 (``plan_reconfiguration``) and at its rejoin
(``plan_rejoin``) and the throughput a node's loss costs. Larger jobs are weak-scaled copies of it (data-parallel
pipelines: the same iteration time and per-rank copies; one node's throughput share scaled by plan_gpus / GPUs).

Recovery measured on this machine (``measure_recovery``): 4 local processes form a ``Membership`` (gloo, plait
launch's ``--timeout`` 10 s as collective timeout and heartbeat staleness), two of them (a "node") SIGKILL
themselves together; the survivors time detection (the failed all-reduce), agreement (waiting for the stale
heartbeats) and re-forming (aborting and re-initialising the gloo group). These seconds are applied at every size
(the store traffic of the agreement grows with the members, see the scale check it prints). ``--no-measure`` uses
an analytic fallback instead (detection 0 s, agreement = the timeout, re-forming 1 s), said in the output.

Run: ``.venv/bin/python bench/goodput.py`` (about a minute; ``--help``).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import multiprocessing
import os
import random
import signal
import socket
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.resilience import Costs, Homogeneous, ckpt_plan, model_parts, restart_cost  # noqa: E402

HOUR_S = 3600.0
LLAMA3_RATE = 419 / (54 * 24 * 16384)
"""Failures per GPU-hour: Llama 3 (Meta 2024, section 3.3.4), 419 interruptions / (54 days * 24 h * 16,384 GPUs)."""
RATES = {"llama3": LLAMA3_RATE,
         "rsc1-node-days": 6.5 / 1000 / 24 / 8,
         "rsc1-1024-mttf": 1 / (7.9 * 1024)}
"""Failures per GPU-hour by source (module docstring)."""
TARGET = 0.97
"""ByteRobust's (ByteDance 2025) reported ETTR: 97% over 3 months on 9,600 GPUs."""
BUCKETS = ("detection", "agreement", "re-forming", "copies", "replay", "checkpoint writes", "degraded",
           "restarts", "rework")
"""Where the wall time that is not productive goes (seconds in :class:`Run`)."""


@dataclass(frozen=True)
class Recovery:
    """plait's per-failure stall components (seconds): detection (the failure to the failed collective),
    agreement (on the survivors) and re-forming (aborting and re-initialising the process group), and where the
    figures come from."""

    detect_s: float
    agree_s: float
    reform_s: float
    source: str
    store_requests_per_s: float = 0.0  # one-key store checks per second (0: not measured)


@dataclass(frozen=True)
class Workload:
    """The representative job (module docstring): its step (seconds), one copy of its parameters and optimizer
    state (bytes), the most bytes one rank receives after losing a node and at its rejoin, the share of the
    ``plan_gpus``-GPU job's throughput one node's loss costs plait (0..1), the GPUs of one fixed replica and of
    the planned job, and how the figures were obtained."""

    iteration_s: float
    state_bytes: float
    fail_copy_bytes: float
    rejoin_copy_bytes: float
    node_share: float
    replica_gpus: int
    plan_gpus: int
    source: str = ""
    fixed_iteration_s: float = 0.0  # the homogeneous plan's step (s); 0: iteration_s


@dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs, ``gpus_per_node`` per node (the failure domain), failing at ``per_gpu_rate_h`` per GPU-hour."""

    gpus: int
    per_gpu_rate_h: float
    gpus_per_node: int = 8

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def failures_per_day(self) -> float:
        return self.gpus * self.per_gpu_rate_h * 24

    @property
    def mtbf_s(self) -> float:
        """The job's mean time between failures (seconds)."""
        return HOUR_S / (self.gpus * self.per_gpu_rate_h)

    @property
    def node_mtbf_s(self) -> float:
        """One node's mean time between failures (seconds): node 0's, the store's (plait) or lighthouse's."""
        return HOUR_S / (self.gpus_per_node * self.per_gpu_rate_h)


class Run:
    """A job on a wall clock: steps of ``iteration_s`` seconds, a checkpoint write of ``write_s`` after every
    ``every_s`` seconds of training (rounded to whole steps; ``inf``: never), the time lost by bucket
    (:data:`BUCKETS`) and the productive seconds (steps at full throughput; ``factor`` < 1 counts the rest of a
    degraded job's steps as ``degraded``)."""

    def __init__(self, iteration_s: float, every_s: float, write_s: float) -> None:
        self.it, self.write = iteration_s, write_s
        self.k = max(1, round(every_s / iteration_s)) if math.isfinite(every_s) else math.inf
        self.t = self.productive = 0.0
        self.since = 0  # steps since the last completed checkpoint
        self.factor = 1.0
        self.lost: dict[str, float] = defaultdict(float)

    def _steps(self, n: int) -> None:
        self.t += n * self.it
        self.productive += n * self.it * self.factor
        self.lost["degraded"] += n * self.it * (1 - self.factor)

    def train_until(self, end: float) -> float:
        """Train from ``t`` to ``end`` (seconds); returns the seconds of the step or write in progress at ``end``
        (not completed; ``t`` is then ``end``)."""
        while True:
            if self.since >= self.k:
                if self.t + self.write > end + 1e-9:
                    break
                self.t += self.write
                self.lost["checkpoint writes"] += self.write
                self.since = 0
                cycle = self.k * self.it + self.write
                cycles = math.floor((end - self.t) / cycle + 1e-9)
                if cycles > 0:  # whole intervals in one go
                    self._steps(cycles * self.k)
                    self.t += cycles * self.write
                    self.lost["checkpoint writes"] += cycles * self.write
                continue
            room = self.k - self.since
            n = min(room, math.floor((end - self.t) / self.it + 1e-9))
            self._steps(n)
            self.since += n
            if n < room:
                break
        partial = max(0.0, end - self.t)
        if self.since >= self.k:  # a write was interrupted: written again later
            self.lost["checkpoint writes"] += partial
            partial = 0.0
        self.t = end
        return partial

    def finish(self, horizon_s: float) -> None:
        """Train until ``horizon_s`` (seconds; at least until ``t``), where the run stops: the step in progress
        then counts as productive."""
        partial = self.train_until(max(horizon_s, self.t))  # before reading productive, which it changes
        self.productive += partial * self.factor

    def stall(self, bucket: str, seconds: float) -> None:
        """The job stops for ``seconds``, charged to ``bucket``."""
        self.t += seconds
        self.lost[bucket] += seconds

    def restart(self, partial: float, seconds: float) -> None:
        """A restart from the last checkpoint: the steps since it and the step in progress (``partial`` s) are
        lost (``rework``), then ``seconds`` of relaunch and reading (``restarts``)."""
        redo = self.since * self.it
        self.productive -= redo * self.factor
        self.lost["degraded"] -= redo * (1 - self.factor)
        self.lost["rework"] += redo + partial
        self.since = 0
        self.factor = 1.0
        self.stall("restarts", seconds)

    @property
    def ettr(self) -> float:
        """Productive seconds / wall seconds."""
        return self.productive / self.t if self.t else 1.0


def failure_events(cluster: Cluster, count: int, seed: int) -> list[tuple[float, int]]:
    """``count`` node failures (time in seconds, node), Poisson at the cluster's rate, nodes uniform."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(1 / cluster.mtbf_s)
        out.append((t, rng.randrange(cluster.nodes)))
    return out


def sim_restart(cluster: Cluster, work: Workload, costs: Costs, failures: list[tuple[float, int]],
                horizon_s: float) -> Run:
    """Checkpoint-restart at Young's interval for the job's MTBF (``ckpt_plan``, ``restart_cost`` of
    bench/resilience.py; seconds and bytes as there); every failure restarts from the last checkpoint."""
    every, write = ckpt_plan(work.state_bytes, cluster.gpus, dataclasses.replace(costs, interval_s=cluster.mtbf_s),
                             1.0)
    run = Run(work.fixed_iteration_s or work.iteration_s, every, write)
    down = restart_cost(work.state_bytes, cluster.gpus, costs)
    for tf, _ in failures:
        run.restart(run.train_until(max(tf, run.t)), down)
    run.finish(horizon_s)
    return run


def _live_recovery(cluster: Cluster, work: Workload, rec: Recovery, costs: Costs, failures: list[tuple[float, int]],
                   horizon_s: float, spare_s: float, plait: bool) -> Run:
    """plait (``plait=True``) or torchft-style fixed replicas (module docstring)."""
    every, write = ckpt_plan(work.state_bytes, cluster.gpus,
                             dataclasses.replace(costs, interval_s=cluster.node_mtbf_s), 1.0)
    run = Run(work.iteration_s if plait else (work.fixed_iteration_s or work.iteration_s), every, write)
    if plait:
        share = work.node_share * work.plan_gpus / cluster.gpus
    else:
        share = max(work.replica_gpus, cluster.gpus_per_node) / cluster.gpus
    events = [(tf, 0, node, 0) for tf, node in failures]
    heapq.heapify(events)
    out, epoch = 0, 0  # nodes out; a restart starts a new epoch (pending rejoins of older epochs are void)
    while events:
        te, kind, node, born = heapq.heappop(events)
        if kind == 1 and born != epoch:
            continue
        partial = run.train_until(max(te, run.t))
        if kind == 1:  # a node rejoins at a step boundary: the step in progress completes
            run.productive += partial * run.factor
            out -= 1
            run.factor = 1 - out * share
            run.stall("re-forming", rec.reform_s)
            if plait:
                run.stall("copies", work.rejoin_copy_bytes / costs.copy_Bps)
            continue
        if node == 0:  # the membership store's (lighthouse's) node: restart from the checkpoint
            run.restart(partial, restart_cost(work.state_bytes, cluster.gpus, costs))
            out, epoch = 0, epoch + 1
            continue
        run.lost["replay"] += partial
        run.stall("detection", rec.detect_s)
        run.stall("agreement", rec.agree_s)
        run.stall("re-forming", rec.reform_s)
        if plait:
            run.stall("copies", work.fail_copy_bytes / costs.copy_Bps)
        out += 1
        run.factor = max(0.0, 1 - out * share)
        heapq.heappush(events, (run.t + spare_s, 1, node, epoch))
    run.finish(horizon_s)
    return run


def sim_plait(cluster: Cluster, work: Workload, rec: Recovery, costs: Costs, failures: list[tuple[float, int]],
              horizon_s: float, spare_s: float) -> Run:
    """plait's recovery (module docstring); seconds, bytes and bytes per second as in :class:`Costs`."""
    return _live_recovery(cluster, work, rec, costs, failures, horizon_s, spare_s, True)


def sim_fixed(cluster: Cluster, work: Workload, rec: Recovery, costs: Costs, failures: list[tuple[float, int]],
              horizon_s: float, spare_s: float) -> Run:
    """torchft-style fixed replicas (module docstring); seconds, bytes and bytes per second as in :class:`Costs`."""
    return _live_recovery(cluster, work, rec, costs, failures, horizon_s, spare_s, False)


def _member(wid: int, world: int, node: int, port: int, timeout_s: float) -> None:
    """One process of :func:`measure_recovery` (worker ``wid``; the last ``node`` workers are the lost node)."""
    import torch
    import torch.distributed as dist

    from plait.parallel.membership import Membership

    torch.set_num_threads(1)
    marks: dict[str, float] = {}

    class Timed(Membership):
        def abandon(self) -> None:
            marks.setdefault("abandon0", time.time())
            super().abandon()
            marks.setdefault("abandon1", time.time())

        def _switch(self, generation, survivors):
            marks["switch0"] = time.time()
            left = super()._switch(generation, survivors)
            marks["switch1"] = time.time()
            return left

    m = Timed("127.0.0.1", port, wid, world, dead_after_s=timeout_s, timeout_s=timeout_s, min_members=world - node)
    m.join()
    one = torch.ones(())
    dist.all_reduce(one)
    m.post(f"ready/{wid}", "1")
    while any(m.posted(f"ready/{w}") is None for w in range(world)):
        time.sleep(0.05)
    if wid >= world - node:
        time.sleep(0.5)
        m.post(f"killed/{wid}", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # training steps until a collective fails
        try:
            dist.all_reduce(torch.ones(()))
            time.sleep(0.01)
        except RuntimeError:
            break
    seen = time.time()
    start = time.time()
    m.reform()
    done = time.time()
    total = torch.ones(())
    dist.all_reduce(total)
    client = dist.TCPStore("127.0.0.1", port, is_master=False)
    n, t0 = 2000, time.perf_counter()
    for _ in range(n):
        client.check(["ready/0"])
    rate = n / (time.perf_counter() - t0)
    killed = min(float(m.posted(f"killed/{w}")) for w in range(world - node, world))
    out = {"detect_s": seen - killed, "total_s": done - start, "sum": float(total), "rate": rate}
    if {"abandon0", "abandon1", "switch0", "switch1"} <= set(marks):
        out["agree_s"] = marks["switch0"] - marks["abandon1"]
        out["reform_s"] = (marks["abandon1"] - marks["abandon0"]) + (marks["switch1"] - marks["switch0"])
    m.post(f"result/{wid}", json.dumps(out))
    m.close()
    os._exit(0)


def measure_recovery(timeout_s: float = 10.0, world: int = 4, node: int = 2, limit_s: float = 90.0) -> Recovery:
    """Time a real ``Membership`` reform on this machine (module docstring): ``world`` processes, the last
    ``node`` SIGKILLed together; the collective timeout and heartbeat staleness are ``timeout_s`` seconds (plait
    launch's default 10 s). Returns the survivors' mean seconds per component and the one-key store check rate
    (requests per second, summed over the survivors measuring at once).

    Raises:
        RuntimeError: when the survivors report nothing within ``limit_s`` seconds or disagree on the members.
    """
    import datetime

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_member, args=(w, world, node, port, timeout_s), daemon=True) for w in range(world)]
    for p in procs:
        p.start()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=limit_s))
    deadline, keys = time.monotonic() + limit_s, [f"result/{w}" for w in range(world - node)]
    try:
        while not store.check(keys):
            if time.monotonic() > deadline or all(not p.is_alive() for p in procs):
                raise RuntimeError(f"no recovery measured within {limit_s:.0f} s")
            time.sleep(0.1)
        results = [json.loads(store.get(k)) for k in keys]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if any(r["sum"] != world - node for r in results):
        raise RuntimeError(f"the survivors disagree on the members: {results}")
    mean = {k: sum(r[k] for r in results) / len(results) for k in results[0] if k in ("detect_s", "total_s",
                                                                                       "agree_s", "reform_s")}
    agree, reform = mean.get("agree_s", mean["total_s"]), mean.get("reform_s", 0.0)
    how = "" if "agree_s" in mean else " (agreement and re-forming not split: their sum under agreement)"
    return Recovery(mean["detect_s"], agree, reform, f"measured on this machine: {world} gloo processes, {node} "
                    f"SIGKILLed together, timeout and staleness {timeout_s:g} s{how}",
                    sum(r["rate"] for r in results))


def plan_workload(model: str, plan_gpus: int, microbatches: int, gpus_per_node: int) -> Workload:
    """The representative job from plait's planner (module docstring): templates (f = 1) for ``plan_gpus`` GPUs
    and ``microbatches`` one-sample microbatches, pipelines on nodes of ``gpus_per_node`` GPUs."""
    from bench.pipeline_plans import DP_LINK, MEMORY_CAP, P2P
    from bench.resilience import state_bytes
    from plait.planner.resilience.reconfigure import plan_reconfiguration, plan_rejoin
    from plait.planner.resilience.templates import plan_instantiation, plan_templates
    from plait.planner.search.types import Machine

    units, costs = model_parts(model)
    machine = Machine(memory_cap=MEMORY_CAP, p2p=P2P, dp_link=DP_LINK)
    ts = plan_templates(units, costs, plan_gpus, 1, microbatches=microbatches, machine=machine)
    domains = {r: r // gpus_per_node for r in range(plan_gpus)}
    inst = plan_instantiation(ts, domains=domains)
    lost = range(gpus_per_node, 2 * gpus_per_node)
    rec = plan_reconfiguration(ts, inst, lost)
    back = plan_rejoin(ts, rec.after, lost, domains=domains)

    def most(r) -> float:
        got: dict[int, int] = defaultdict(int)
        for tr in r.transfers:
            got[tr.dst] += tr.bytes
        return float(max(got.values(), default=0))

    home = Homogeneous(units, costs, microbatches).plan(plan_gpus)
    src = (f"{model} planned by plait on {plan_gpus} GPUs ({microbatches} microbatches): {inst.describe()}; after "
           f"losing node 1: {'; '.join(rec.actions)}, {rec.after.iteration_s:.3f} s per iteration; fixed replica: "
           f"plan_layout's DP {home.dp} x {home.plan.num_ranks} ranks, {home.iteration_s:.3f} s")
    return Workload(inst.iteration_s, state_bytes(ts), most(rec), most(back), 1 - inst.iteration_s /
                    rec.after.iteration_s, home.plan.num_ranks, plan_gpus, src, home.iteration_s)


def _pct(x: float) -> str:
    return f"{100 * x:6.2f}%"


def report(rate_name: str, rate: float, args: argparse.Namespace, work: Workload, rec: Recovery,
           costs: Costs) -> dict[int, dict[str, Run]]:
    """Simulate and print the table and plait's breakdown for one failure rate; returns the runs by GPU count."""
    print(f"\nFailure rate '{rate_name}': {rate:.3e} per GPU-hour ({rate * args.gpus_per_node:.3e} per node-hour)")
    head = (f"{'GPUs':>6} {'nodes':>5} {'fail/day':>8} {'MTBF h':>7} | {'plait':>7} {'restart':>7} {'fixed':>7} | "
            "restart: Young's ckpt every s, write s, restart s; plait's")
    print(head + "\n" + "-" * len(head))
    runs: dict[int, dict[str, Run]] = {}
    for gpus in args.gpus:
        cl = Cluster(gpus, rate, args.gpus_per_node)
        fails = failure_events(cl, args.failures, args.seed)
        horizon = fails[-1][0] + cl.mtbf_s
        runs[gpus] = {"plait": sim_plait(cl, work, rec, costs, fails, horizon, args.spare_s),
                      "restart": sim_restart(cl, work, costs, fails, horizon),
                      "fixed": sim_fixed(cl, work, rec, costs, fails, horizon, args.spare_s)}
        r = runs[gpus]
        every, write = ckpt_plan(work.state_bytes, gpus, dataclasses.replace(costs, interval_s=cl.mtbf_s), 1.0)
        p_every, _ = ckpt_plan(work.state_bytes, gpus, dataclasses.replace(costs, interval_s=cl.node_mtbf_s), 1.0)
        print(f"{gpus:>6} {cl.nodes:>5} {cl.failures_per_day:8.2f} {cl.mtbf_s / HOUR_S:7.2f} | "
              f"{_pct(r['plait'].ettr)} {_pct(r['restart'].ettr)} {_pct(r['fixed'].ettr)} | {every:8.1f} "
              f"{write:6.3f} {restart_cost(work.state_bytes, gpus, costs):6.1f}; {p_every:8.0f}")
    print("plait's lost time, % of wall time (per failure: detection, agreement, re-forming at the failure and the "
          "rejoin; copies; replay of the interrupted step; checkpoint writes; degraded: throughput of nodes out; "
          "restarts + rework: node 0's failures)")
    print(f"{'GPUs':>6} " + " ".join(f"{b:>10}" for b in BUCKETS))
    for gpus, r in runs.items():
        p = r["plait"]
        print(f"{gpus:>6} " + " ".join(f"{100 * p.lost[b] / p.t:9.3f}%" for b in BUCKETS))
    big = max(runs)
    met = runs[big]["plait"].ettr >= TARGET
    above = all(r["plait"].ettr > r["restart"].ettr for r in runs.values())
    print(f"Target: plait >= {TARGET:.0%} at {big} GPUs: {'met' if met else 'NOT met'} "
          f"({runs[big]['plait'].ettr:.2%}); above restart at every size: {'yes' if above else 'NO'}")
    if rec.store_requests_per_s:
        polls = rec.agree_s / 0.1  # the settler polls every heartbeat_s / 2 = 0.1 s until the agreement settles
        print("Scale check (not in the table): the store traffic of one failure under membership.reform (each "
              "survivor: an arrival count, its present mark, a server-side wait and a read; the first arrival alone "
              "polls the present list and the lost node's keys every 0.1 s), at "
              f"{rec.store_requests_per_s:,.0f} requests/s (measured here, one TCPStore):")
        for gpus, r in runs.items():
            cl = Cluster(gpus, rate, args.gpus_per_node)
            requests = 4 * gpus + polls * (1 + 4 * args.gpus_per_node)
            extra = requests / rec.store_requests_per_s
            lost = extra * args.failures / r["plait"].t
            verdict = (f"plait's ETTR with it {r['plait'].ettr - lost:.2%}" if extra < cl.mtbf_s else
                       f"longer than the {cl.mtbf_s:.0f} s MTBF: the job would not keep up")
            print(f"  {gpus:>6} workers: {requests:10,.0f} requests, {extra:8.2f} s per failure; {verdict}")
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--gpus", type=int, nargs="+", default=[1024, 4096, 16384], help="job sizes (GPUs)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, the failure domain")
    parser.add_argument("--rates", nargs="+", default=["llama3"], choices=sorted(RATES),
                        help="published failure rates to report (module docstring)")
    parser.add_argument("--per-gpu-rate", type=float, default=None,
                        help="failures per GPU-hour, instead of --rates (default: Llama 3's 419/(54*24*16384))")
    parser.add_argument("--failures", type=int, default=2000, help="failures simulated per size")
    parser.add_argument("--model", default="VLM-M", help="the representative model (bench/resilience.py's)")
    parser.add_argument("--plan-gpus", type=int, default=32, help="GPUs plait plans the representative job on")
    parser.add_argument("--microbatches-per-gpu", type=int, default=2,
                        help="microbatches per GPU of the representative job's global batch")
    parser.add_argument("--copy-gbps", type=float, default=25.0, help="GB/s per GPU inter-node for unit copies")
    parser.add_argument("--restart-s", type=float, default=120.0,
                        help="relaunch before reading the checkpoint (s; bench/resilience.py's assumption)")
    parser.add_argument("--ckpt-gbps", type=float, default=2.0, help="GB/s each GPU writes / reads checkpoints at")
    parser.add_argument("--spare-s", type=float, default=1800.0, help="seconds until a lost node's spare joins")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="membership timeout and heartbeat staleness (s; plait launch's --timeout default)")
    parser.add_argument("--no-measure", action="store_true", help="analytic recovery instead of measuring")
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulated failure times and nodes")
    args = parser.parse_args(argv)
    rates = {"given": args.per_gpu_rate} if args.per_gpu_rate else {k: RATES[k] for k in args.rates}
    print(f"Llama 3 (Meta 2024, 3.3.4): 419 interruptions / (54 d x 24 h x 16384 GPUs) = {LLAMA3_RATE:.3e} "
          f"failures per GPU-hour; RSC-1 (Kokolis et al.): {RATES['rsc1-node-days']:.3e} (6.5 per 1000 node-days), "
          f"{RATES['rsc1-1024-mttf']:.3e} (7.9 h MTTF at 1024 GPUs); target {TARGET:.0%} (ByteRobust, 9,600 GPUs).")
    fallback = Recovery(0.0, args.timeout, 1.0, f"ANALYTIC FALLBACK: detection 0 s (sockets close), agreement = "
                        f"the {args.timeout:g} s heartbeat staleness, re-forming 1 s (assumed)")
    rec = fallback
    if not args.no_measure:
        start = time.perf_counter()
        try:
            rec = measure_recovery(args.timeout)
        except (RuntimeError, OSError) as err:
            rec = dataclasses.replace(fallback, source=f"{fallback.source}; the measurement failed: {err}")
        print(f"Recovery measured in {time.perf_counter() - start:.1f} s.")
    print(f"plait recovery ({rec.source}): detection {rec.detect_s:.3f} s, agreement {rec.agree_s:.3f} s, "
          f"re-forming {rec.reform_s:.3f} s")
    start = time.perf_counter()
    work = plan_workload(args.model, args.plan_gpus, args.microbatches_per_gpu * args.plan_gpus, args.gpus_per_node)
    costs = Costs("goodput", 0.0, rec.detect_s + rec.agree_s + rec.reform_s, args.copy_gbps * 1e9, args.restart_s,
                  args.ckpt_gbps * 1e9)
    print(f"Workload ({time.perf_counter() - start:.1f} s): {work.source}.")
    print(f"  state {work.state_bytes / 1e9:.0f} GB (checkpoint: one copy written by all GPUs at "
          f"{args.ckpt_gbps:g} GB/s each); copies at {args.copy_gbps:g} GB/s per GPU (assumed): after a node's "
          f"loss {work.fail_copy_bytes / 1e9:.1f} GB -> {work.fail_copy_bytes / costs.copy_Bps:.2f} s, at its "
          f"rejoin {work.rejoin_copy_bytes / 1e9:.1f} GB -> {work.rejoin_copy_bytes / costs.copy_Bps:.2f} s; a "
          f"node out costs plait {work.node_share:.1%} of {work.plan_gpus} GPUs' throughput, fixed a "
          f"{work.replica_gpus}-GPU replica. Assumed: restart {args.restart_s:g} s + read, spare after "
          f"{args.spare_s:g} s; weak scaling to larger jobs.")
    for name, rate in rates.items():
        report(name, rate, args, work, rec, costs)


if __name__ == "__main__":
    main()
