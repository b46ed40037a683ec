"""``plait launch``: start a resilient job (``plait.train.resilient``) of ``--nproc`` worker processes that keeps
training when workers die, rank 0 included.

The launcher, not torchrun: torchrun's elastic agent restarts every worker of the job on a failure (a restart
from the last checkpoint), and torchft protects identical replicas only; plait's pipelines are heterogeneous
replicas reshaped in place. The launcher:

1. checks the job (:func:`check_launch`: a layout of its own, fault injection naming real workers)
   and the run folder (an earlier run's checkpoints, final model or launch logs are refused, or removed together
   with ``--overwrite`` once every argument is checked and the plan made, as ``plait train`` does); plans the
   pipeline templates for ``--nproc`` ranks and ``--f`` failures (``plan_templates`` on the job's analytic unit
   costs and runtime overheads for this host's CPU or ``--device``, chosen as ``plait plan`` chooses them:
   :func:`launch_device`) and the first instantiation (``plan_instantiation``, or the pipeline sizes of
   ``--pipelines``), written to
   ``<metrics.run_dir>/resilient/launch.json``;
2. hosts the membership ``TCPStore`` in its own process, so no worker's death takes it down;
3. starts the workers (``plait launch --worker ID --store HOST:PORT``, same config and overrides) and waits for
   them, writing ``dead/<id>`` in the store when one exits (the survivors' agreement then does not wait for its
   heartbeat to go stale).

Metrics (``metrics.jsonl``), validation (``train.eval_every`` and the end, through the pipelines) and checkpoints
(``checkpoint.every`` and the end) are done as ``plait train`` does them (``plait.train.resilient``); ``plait train --resume`` continues a launched run with any ordinary
layout.

Exit status: 0 when every worker that was not killed by a signal finished; otherwise the first failing worker's.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from plait.models.device import host_cpu_threads
from plait.parallel.membership import closed, forget_process, last_beat
from plait.models.plan_inputs import build_plan_inputs, device_spec
from plait.measure.host_costs import RuntimeCosts, host_cpu, runtime_costs
from plait.config.loader import load_config
from plait.planner.cost.types import DeviceSpec
from plait.planner.search.types import Machine
from plait.planner.resilience.templates import (instantiate, node_domains, plan_instantiation, plan_templates,
                                                units_on_few_domains)
from plait.train.faults import node_pids_key
from plait.train.launch_plan import LaunchPlan
from plait.train.resilient import run_resilient_worker
from plait.train.run_lock import hold_run_lock
from plait.train.run_start import clear_earlier_run, launch_logs

__all__ = ["NodeRole", "check_launch", "launch_command", "launch_device", "launch_plan", "parse_kills",
           "unfinished_message", "worker_command", "worker_main"]


def parse_kills(values: Sequence[str], what: str = "WORKER") -> tuple[tuple[int, int], ...]:
    """``WORKER:STEP`` strings (``--kill``, ``--rejoin``, ``--stop``; ``NODE:STEP`` for ``--kill-node``, ``what``) as
    pairs.

    Raises:
        ValueError: naming a malformed value.
    """
    out = []
    for v in values:
        parts = v.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"{v!r}: expected {what}:STEP (two non-negative integers)")
        out.append((int(parts[0]), int(parts[1])))
    return tuple(out)


def check_launch(cfg, nproc: int, kills: Sequence[tuple[int, int]] = (),
                 rejoins: Sequence[tuple[int, int]] = (), stops: Sequence[tuple[int, int]] = (),
                 node_kills: Sequence[tuple[int, int]] = (), nnodes: int = 1) -> None:
    """Refuse what ``plait launch`` would otherwise ignore silently (``nproc``: workers of the whole job, over
    ``nnodes`` nodes).

    Raises:
        ValueError: naming the setting: ``parallel.tp`` or ``parallel.cp`` above 1 (no tensor or context
            parallelism inside the pipelines), ``parallel.pp.encoder_dp`` or ``encoder_tp`` above 1 (no replicated or TP encoder stages),
            ``parallel.dp_shard`` not dividing ``nproc`` or together with ``--rejoin`` or several nodes
            (:func:`_check_sharding`); a ``--kill``, ``--stop`` or ``--rejoin`` of a worker id outside ``0..nproc-1`` (naming the valid
            ids), a ``--kill-node`` of a node outside ``0..nnodes-1``, or any of them at a step past the job's last
            (``0..train.steps-1``, 0-based; not checked for a job of ``train.epochs``, whose step count depends on
            its data); a ``--rejoin`` that cannot happen (:func:`_check_rejoins`).
    """
    p = cfg.parallel
    what = {"tp": ("tensor", "the layers' weights"), "cp": ("context", "the layers' sequences"),
            "ep": ("expert", "the experts")}
    for name, value in (("tp", p.tp), ("cp", p.cp), ("ep", p.ep)):
        if value > 1:
            kind, split = what[name]
            raise ValueError(f"parallel.{name} = {value}: plait launch plans its own pipelines (heterogeneous "
                             "data-parallel replicas of whole layers, FSDP2 inside them with parallel.dp_shard) and "
                             f"runs no {kind} parallelism inside them: a failure would have to re-split {split} "
                             "over the survivors, which its reconfiguration does not do; set "
                             f"--parallel.{name}=1, or train with plait train under torchrun (not resilient)")
    for name, what in (("encoder_dp", "replicated"), ("encoder_tp", "tensor-parallel")):
        copied = {b: d for b, d in getattr(p.pp, name).items() if d > 1}
        if copied:
            raise ValueError(f"parallel.pp.{name} = {copied}: plait launch plans its own pipelines, with no {what} "
                             "encoder stages; drop it, or train with plait train under torchrun (not resilient)")
    _check_sharding(p.dp_shard, nproc, nnodes, rejoins)
    for flag, pairs, count, what in (("--kill", kills, nproc, "worker"), ("--rejoin", rejoins, nproc, "worker"),
                                     ("--stop", stops, nproc, "worker"), ("--kill-node", node_kills, nnodes, "node")):
        bad = sorted({w for w, _ in pairs if not 0 <= w < count})
        if bad:
            raise ValueError(f"{flag}: no {what} {', '.join(map(str, bad))} (the {what}s are 0..{count - 1})")
        steps = cfg.train.steps
        late = sorted({s for _, s in pairs if steps > 0 and s >= steps})
        if late:
            raise ValueError(f"{flag}: step {', '.join(map(str, late))} is past the job's last step (train.steps = "
                             f"{steps}: the steps are 0..{steps - 1}, 0-based), so it would never happen; pick a "
                             "step in that range or raise --train.steps")
    if any(n == 0 for n, _ in node_kills):
        raise ValueError("--kill-node 0: node 0's launcher hosts the membership store, and the job ends with it; "
                         "kill another node")
    domains = node_domains(nproc, nnodes) or {}
    deaths = [*kills, *stops, *((w, s) for n, s in node_kills for w, d in domains.items() if d == n)]
    _check_rejoins(deaths, rejoins)


def _check_sharding(dp_shard: int, nproc: int, nnodes: int, rejoins: Sequence[tuple[int, int]]) -> None:
    """Refuse ``parallel.dp_shard`` (FSDP2 inside every pipeline, shard groups of ``dp_shard`` workers:
    ``plait.planner.resilience.shards``) where the launcher cannot run it.

    Raises:
        ValueError: when it does not divide ``nproc``; with a ``--rejoin`` (a failed worker's partners leave
            the job, so a restarted worker would join an incomplete group) or several nodes (a node started again
            rejoins the same way).
    """
    if dp_shard <= 1:
        return
    if nproc % dp_shard:
        raise ValueError(f"parallel.dp_shard = {dp_shard} must divide the {nproc} workers: the plan's pipelines are "
                         "made of shard groups of dp_shard workers")
    if rejoins or nnodes > 1:
        flag = "--rejoin" if rejoins else "--nnodes above 1"
        raise ValueError(f"{flag} with parallel.dp_shard = {dp_shard}: when a worker of a shard group fails its "
                         "partners leave the job with it, and plait launch cannot yet admit a group back (a restarted "
                         "worker or node); drop the flag, or set --parallel.dp_shard=1")


def _check_rejoins(kills: Sequence[tuple[int, int]], rejoins: Sequence[tuple[int, int]]) -> None:
    """Refuse a ``--rejoin W:S`` that cannot happen: the launcher restarts a worker once, after its first death
    (``kills``: ``--kill``, ``--stop``, or its node's ``--kill-node``), and the members admit it at the start of
    step ``S``, so ``S`` must come after that step.

    Raises:
        ValueError: naming the worker, the steps and the rule: a rejoin of a worker no ``--kill`` stops, a second
            rejoin of one worker, or a rejoin at or before the worker's first kill step.
    """
    first_kill: dict[int, int] = {}
    for w, s in kills:
        first_kill[w] = min(s, first_kill.get(w, s))
    seen: dict[int, int] = {}
    for w, s in rejoins:
        if w in seen:
            raise ValueError(f"--rejoin {w}:{seen[w]} and --rejoin {w}:{s}: worker {w} rejoins at most once (the "
                             "launcher restarts a killed worker once)")
        seen[w] = s
        if w not in first_kill:
            raise ValueError(f"--rejoin {w}:{s} needs a --kill or --stop of worker {w} (or --kill-node of its node) at "
                             "an earlier step (only a dead worker is restarted to rejoin), or it would never happen")
        if s <= first_kill[w]:
            raise ValueError(f"--rejoin {w}:{s} must come after --kill {w}:{first_kill[w]}: worker {w} rejoins at "
                             f"the start of a step after the one it dies in (step {first_kill[w] + 1} or later)")


def launch_device(cfg, nproc: int, device: str | None = None) -> tuple[DeviceSpec, RuntimeCosts]:
    """The device and runtime costs ``plait launch`` plans with, chosen as ``plait plan`` chooses them
    (``plait.measure.host_costs``): the preset ``device`` (``plan_inputs.DEVICES``, ``--device``), else this host's CPU measured
    (``host_cpu``, with the threads each of the ``nproc`` workers will take, ``models.device.host_cpu_threads``;
    memory: RAM / ``nproc``), as
    ``plait plan`` does on a host without a GPU: the resilient workers train on the CPU with gloo
    (``plait.train.resilient``), GPU or not. Costs: the device's link, DP all-reduce link and per-chunk,
    per-action and per-message overheads (``runtime_costs``, analytic: no stored profile).

    Raises:
        ValueError: on an unknown preset name.
    """
    if device is None:
        spec = host_cpu(host_cpu_threads(cfg.train.threads, nproc)[0], nproc)  # what each worker will run
    else:
        spec = device_spec(device)
    return spec, runtime_costs(spec)


def launch_plan(cfg, nproc: int, failures: int, pipelines: Sequence[int] = (), timeout_s: float = 10.0,
                kills: Sequence[tuple[int, int]] = (), rejoins: Sequence[tuple[int, int]] = (),
                device: tuple[DeviceSpec, RuntimeCosts] | None = None, nodes: int = 1,
                stops: Sequence[tuple[int, int]] = (), node_kills: Sequence[tuple[int, int]] = ()) -> LaunchPlan:
    """Templates for ``nproc`` ranks and ``failures`` failures and the first instantiation (the given pipeline
    sizes in worker order, else the fastest predicted). Costs are analytic, for ``device`` (default
    :func:`launch_device`): its unit costs, memory, links and runtime overheads. With ``nodes > 1`` (``nproc /
    nodes`` workers each, numbered node by node), ``failures`` counts nodes: every unit's copies lie on
    ``failures + 1`` nodes (``plan_instantiation``'s failure domains; given sizes are checked). With
    ``parallel.dp_shard`` > 1 the plan's ranks are shard groups of that many workers (``plait.planner.resilience.
    shards``; the sizes given count workers, multiples of it) and ``failures`` counts groups.

    Raises:
        ValueError: when the sizes do not add up to ``nproc``, a first pipeline's plan leaves some of its workers
            without a stage (spares, which the workers cannot run), given sizes put every copy of some unit on
            fewer than ``failures + 1`` nodes (naming them), fewer than ``failures + 1`` nodes, or from
            ``plan_templates`` / ``instantiate``.
    """
    spec, costs = device or launch_device(cfg, nproc)
    inputs = build_plan_inputs(cfg, spec)
    machine = Machine(memory_cap=spec.memory_bytes, p2p=costs.p2p, dp_link=costs.dp_link, dtype=inputs.dtype,
                      overheads=costs.overheads)
    d = cfg.parallel.dp_shard  # FSDP2 inside the pipelines: the planner's ranks are shard groups of d workers
    templates = plan_templates(inputs.units, inputs.costs, nproc, failures, microbatches=inputs.microbatches,
                               machine=machine, dp_shard=d)
    domains = node_domains(nproc // d, nodes)
    if domains is not None and nodes < failures + 1:
        raise ValueError(f"--f {failures} counts nodes on a job of several: {nodes} nodes cannot hold "
                         f"{failures + 1} copies of every unit on different nodes; lower --f or add nodes")
    if pipelines:
        if sum(pipelines) != nproc:
            raise ValueError(f"--pipelines {list(pipelines)} use {sum(pipelines)} workers, the job has {nproc}")
        if any(n % d for n in pipelines):
            raise ValueError(f"--pipelines {list(pipelines)}: with parallel.dp_shard = {d} every pipeline's size must "
                             f"be a multiple of {d} (a pipeline is made of shard groups of {d} workers)")
        groups = [n // d for n in pipelines]
        starts = [sum(groups[:i]) for i in range(len(groups))]
        inst = instantiate(templates, [list(range(s, s + n)) for s, n in zip(starts, groups)])
        few = units_on_few_domains(inst, domains, failures + 1) if domains is not None else ()
        if few:
            raise ValueError(f"--pipelines {list(pipelines)}: every copy of {', '.join(few[:4])}"
                             f"{' ...' if len(few) > 4 else ''} lies on fewer than {failures + 1} nodes (--f "
                             f"{failures} counts nodes, {nproc // nodes} workers each); give other sizes or leave "
                             "--pipelines out to let the planner spread them")
    else:
        inst = plan_instantiation(templates, domains=domains)
    spares = inst.spares()
    if spares:  # the planner keeps them as spares; the workers cannot run a rank without a stage yet
        n, used = spares[0]  # shard groups of d workers
        raise ValueError(f"a pipeline of {n * d} workers: the fastest plan for {spec.name} runs on {used * d} of them "
                         "and plait launch cannot leave a worker idle as a spare; give smaller pipelines with "
                         "--pipelines, fewer workers with --nproc, or plan for another --device")
    return LaunchPlan(templates, inst, timeout_s, tuple(kills), tuple(rejoins), nodes, tuple(stops),
                      tuple(node_kills))


def worker_command(config: str | Path, overrides: Sequence[str], worker: int, world: int, store: str,
                   joining: bool = False) -> list[str]:
    """The command line of one worker process (``joining``: restarted, it joins the running job)."""
    return [sys.executable, "-m", "plait.cli", "launch", "--config", str(config), "--nproc", str(world),
            "--worker", str(worker), "--store", store, *(["--joining"] if joining else []), *overrides]


def _wait(procs: dict[int, subprocess.Popen], store: dist.TCPStore, limit_s: float | None,
          restart: Callable[[int], subprocess.Popen | None], hang_s: float | None = None) -> dict[int, int]:
    """Wait for this node's workers (by worker id); write ``dead/<id>`` when one exits with an error, then
    ``restart`` it (a process, or None to leave it dead). A worker whose heartbeat (``hb/<id>``, written every
    0.2 s by its membership thread) is older than ``hang_s`` seconds while its process lives is hung (stopped,
    or stuck holding the interpreter): it is SIGKILLed, which fences it (a killed process writes nothing late;
    its sockets close, so its peers' collectives fail at once) and counts as its death. Returns the exit codes."""
    codes: dict[int, int | None] = {w: None for w in procs}
    deadline = None if limit_s is None else time.monotonic() + limit_s
    while any(c is None for c in codes.values()):
        for w, p in procs.items():
            if codes[w] is None and hang_s is not None and p.poll() is None and (age := _silent_s(store, w)) > hang_s:
                p.kill()
                p.wait()
                print(f"plait launch: worker {w} sent no heartbeat for {age:.1f} s (--hang-timeout {hang_s:g}): "
                      "killed as hung", flush=True)
            if codes[w] is None and (rc := p.poll()) is not None:
                codes[w] = rc
                if rc != 0:
                    store.set(f"dead/{w}", str(rc))
                    print(f"plait launch: worker {w} exited with {'signal ' + str(-rc) if rc < 0 else rc}",
                          flush=True)
                    if rc < 0 and (again := restart(w)) is not None:
                        procs[w], codes[w] = again, None
                        print(f"plait launch: worker {w} restarted to rejoin", flush=True)
        if deadline is not None and time.monotonic() > deadline:
            for w, p in procs.items():
                if codes[w] is None:
                    p.kill()
                    codes[w] = p.wait()
            print(f"plait launch: stopped workers still running after {limit_s} s", file=sys.stderr)
        time.sleep(0.05)
    return {w: int(c) for w, c in codes.items()}


def _silent_s(store: dist.TCPStore, worker: int) -> float:
    """Seconds since ``worker``'s last heartbeat (``membership.last_beat``); 0 before its first (it is starting) and
    after it closed its membership (it is finishing)."""
    beat = last_beat(store, worker)
    return 0.0 if beat is None or closed(store, worker) else time.time() - beat


def _refuse_earlier_run(run_dir: Path) -> None:
    """Refuse a run folder holding an earlier launch's logs or an earlier run's checkpoints or final model (without
    ``--overwrite``), naming this command's flag."""
    logs = launch_logs(run_dir)
    if logs:
        raise ValueError(f"{run_dir / 'resilient'} holds an earlier launch's logs ({len(logs)} files), which a new "
                         "run would remove: replace them with plait launch ... --overwrite, or write this run "
                         "elsewhere with --metrics.run_dir=DIR")
    try:
        clear_earlier_run(run_dir, True, 1, overwrite=False)
    except ValueError as exc:  # the guard names plait train's flag: this command has the same one
        raise ValueError(str(exc).replace("`plait train --config JOB --overwrite`",
                                          "`plait launch --config JOB --nproc N --overwrite`")) from None


@dataclass(frozen=True)
class NodeRole:
    """This launcher's place in a job of several nodes (one launcher, the node's agent, per node).

    Attributes:
        nnodes: the job's nodes (``--nnodes``).
        rank: this node's rank (``--node-rank``); node ``r`` runs workers ``r * nproc .. (r + 1) * nproc - 1``.
        store: ``HOST:PORT`` of the membership ``TCPStore`` (``--store``). Node 0's agent hosts it there (listening
            on every interface of its host); the others connect to it. On one node it may be empty (a free port on
            127.0.0.1).

    Raises:
        ValueError: on a node rank outside ``0..nnodes-1`` or several nodes without ``--store HOST:PORT``.
    """

    nnodes: int = 1
    rank: int = 0
    store: str = ""

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.rank < self.nnodes:
            raise ValueError(f"--node-rank {self.rank} outside 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        host, _, port = self.store.rpartition(":")
        if self.store and not (host and ":" not in host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"--store {self.store!r}: expected HOST:PORT with a host name or IPv4 address and a port "
                             "in 1..65535, e.g. node0.cluster:29400")
        if self.nnodes > 1 and not self.store:
            raise ValueError("--nnodes above 1 needs --store HOST:PORT: where node 0's launcher hosts the membership "
                             "store and the other nodes' launchers and workers reach it")

    def address(self) -> tuple[str, int]:
        """The store's host and port (port 0: any free one, on one node without ``--store``)."""
        if not self.store:
            return "127.0.0.1", 0
        host, _, port = self.store.rpartition(":")
        return host, int(port)


def launch_command(config: str | Path, nproc: int, failures: int, overrides: Sequence[str] = (),
                   pipelines: Sequence[int] = (), kills: Sequence[str] = (), timeout_s: float = 10.0,
                   limit_s: float | None = None, rejoins: Sequence[str] = (), overwrite: bool = False,
                   device: str | None = None, node: NodeRole = NodeRole(), hang_s: float | None = 60.0,
                   stops: Sequence[str] = (), node_kills: Sequence[str] = ()) -> int:
    """Check, plan (for ``device``: :func:`launch_device`, printed), host the store, run this node's ``nproc``
    workers to the end (module docstring); on a node other than 0 (``node``), read the plan from the store instead
    and start the node's workers, joining the running job when it already formed (a node started again after it
    was lost). ``hang_s``: a worker silent for longer is killed as hung (None: never). Returns the exit status.

    Raises:
        ValueError: on bad numbers, settings :func:`check_launch` refuses, a run folder holding an earlier run
            (without ``overwrite``), or a job that cannot hold ``failures + 1`` pipelines. Every argument is checked
            before ``overwrite`` removes the earlier run (checkpoints, final model and launch logs together).
        RuntimeError: (the store's ``DistStoreError``) on a node other than 0 when node 0's plan does not come
            within 10 minutes.
    """
    world = nproc * node.nnodes
    if nproc < 1 or world < 2:
        raise ValueError(f"a resilient job needs 2 workers or more: --nproc {nproc} on {node.nnodes} node(s)")
    if failures < 0:
        raise ValueError(f"--f must be >= 0 (simultaneous failures to survive), got {failures}")
    if hang_s is not None and hang_s <= 0:
        raise ValueError(f"--hang-timeout must be > 0 seconds (or 0: never), got {hang_s}")
    cfg = load_config(config, overrides)
    kills_, rejoins_, stops_ = parse_kills(kills), parse_kills(rejoins), parse_kills(stops)
    node_kills_ = parse_kills(node_kills, "NODE")
    check_launch(cfg, world, kills_, rejoins_, stops_, node_kills_, node.nnodes)
    run_dir = Path(cfg.metrics.run_dir)
    out = run_dir / "resilient"
    workers = list(range(node.rank * nproc, (node.rank + 1) * nproc))
    host, port = node.address()
    if node.rank > 0:  # node 0 checked the run folder, planned, and holds its lock
        print(f"plait launch: node {node.rank} of {node.nnodes}: waiting (up to 10 minutes) for node 0's plan at "
              f"{node.store}", flush=True)
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=600))
        store.wait(["launch/plan"])
        text = store.get("launch/plan").decode()
        planned = LaunchPlan.from_json(text)
        if (planned.nodes, planned.per_node) != (node.nnodes, nproc):
            raise ValueError(f"node 0 planned {planned.nodes} nodes of {planned.per_node} workers, this launcher has "
                             f"--nnodes {node.nnodes} --nproc {nproc}: start every node with the same --nnodes and "
                             "--nproc")
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "launch.json").is_file() or (out / "launch.json").read_text() != text:  # no shared folder
            (out / "launch.json").write_text(text)
        joining = store.check(["formed"])
        print(f"plait launch: node {node.rank} of {node.nnodes}: workers {workers[0]}..{workers[-1]}"
              f"{', joining the running job' if joining else ''}", flush=True)
        return _run_node(config, overrides, planned, store, node.store, workers, joining, limit_s, hang_s, out)
    if node.nnodes > 1:
        try:
            socket.getaddrinfo(host, port)
        except OSError as exc:
            raise ValueError(f"--store {node.store}: the host {host!r} does not resolve here ({exc}); give node 0's "
                             "host name or address, which every node can reach") from None
    if not overwrite:
        _refuse_earlier_run(run_dir)
    costs = launch_device(cfg, nproc, device)
    why = ("--device" if device is not None
           else "the workers train on this host's CPU with gloo; --device to plan for another")
    print(f"plait launch: planning for {costs[0].name} ({why}); costs: {costs[1].source}", flush=True)
    plan = launch_plan(cfg, world, failures, pipelines, timeout_s, kills_, rejoins_, costs, node.nnodes, stops_,
                       node_kills_)
    # only once every argument is checked (a refused command leaves the folder as it was, not even created), the
    # launcher takes the run folder's lock and holds it while its workers write the folder
    with hold_run_lock(run_dir):
        if overwrite:
            clear_earlier_run(run_dir, True, 1, overwrite=True)
        out.mkdir(parents=True, exist_ok=True)
        text = plan.to_json()
        (out / "launch.json").write_text(text)
        nodes = f" on {node.nnodes} nodes of {nproc}" if node.nnodes > 1 else ""
        d = plan.templates.dp_shard
        shards = f" in shard groups of {d} workers (FSDP2)" if d > 1 else ""
        print(f"plait launch: {world} workers{nodes}{shards}, f = {failures}: {plan.instantiation.describe(d)}",
              flush=True)
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
        store.set("launch/plan", text)
        address = node.store or f"127.0.0.1:{store.port}"
        return _run_node(config, overrides, plan, store, address, workers, False, limit_s, hang_s, out)


def _run_node(config: str | Path, overrides: Sequence[str], plan: LaunchPlan, store: dist.TCPStore, address: str,
              workers: Sequence[int], joining: bool, limit_s: float | None, hang_s: float | None, out: Path) -> int:
    """Start this node's ``workers`` (``joining``: into the running job), keep their pids in the store
    (``faults.node_pids_key``), restart those planned to rejoin once they die, and wait for them all; returns the
    exit status (the first worker that failed, or 0)."""
    world = plan.templates.workers

    def start(w: int, again: bool) -> subprocess.Popen:
        forget_process(store, w)
        return subprocess.Popen(worker_command(config, overrides, w, world, address, joining=again))

    started = time.time()
    procs = {w: start(w, joining) for w in workers}
    node = workers[0] // plan.per_node
    store.set(node_pids_key(node), json.dumps([p.pid for p in procs.values()]))
    pending = set() if joining else {w for w, _ in plan.rejoins if w in procs}

    def restart(w: int) -> subprocess.Popen | None:
        if w not in pending:
            return None
        pending.discard(w)
        procs[w] = start(w, True)
        store.set(node_pids_key(node), json.dumps([p.pid for p in procs.values()]))
        return procs[w]

    try:
        codes = _wait(procs, store, limit_s, restart, hang_s)
    except RuntimeError as exc:  # DistNetworkError: the store's host (node 0's launcher) is gone, the job with it
        for p in procs.values():
            p.kill()
        print(f"plait launch: lost the membership store at {address} ({exc}); node 0's launcher ended, and the job "
              "with it: this node's workers are stopped", file=sys.stderr, flush=True)
        return 1
    failed = [(w, c) for w, c in sorted(codes.items()) if c > 0]
    if failed:
        print(f"plait launch: worker {failed[0][0]} failed (exit {failed[0][1]}); logs in {out}", file=sys.stderr)
        return failed[0][1]
    unfinished = unfinished_message(codes, out, started)
    if unfinished:
        print(unfinished, file=sys.stderr, flush=True)
        return 1
    print(f"plait launch: done; per-step logs and final parameters in {out}", flush=True)
    return 0


def unfinished_message(codes: dict[int, int], out: Path, since: float) -> str | None:
    """Why the job did not finish on this node, or None when it did: ``codes`` (worker -> exit status; negative: the
    signal that ended it, 0: it ended or left the job) are the node's workers', none of which failed with an error;
    the job finished when one of them wrote its final parameters (``final-worker<id>.pt`` in ``out``) since ``since``
    (seconds since the epoch). Without this check a job whose workers were all killed or left would read as done."""
    for worker in codes:
        path = out / f"final-worker{worker}.pt"
        if path.is_file() and path.stat().st_mtime >= since:
            return None
    ends = ", ".join(f"worker {w} {'killed by signal ' + str(-c) if c < 0 else 'left the job'}"
                     for w, c in sorted(codes.items()))
    return (f"plait launch: the job did not finish: no worker of this node reached the end and wrote its final "
            f"parameters ({ends}); logs and the last checkpoint are in {out} (plait train --resume continues it)")


def worker_main(config: str | Path, overrides: Sequence[str], worker: int, world: int, store: str,
                joining: bool = False) -> int:
    """One worker process (started by :func:`launch_command`); ends the process with status 0, or 3 with the
    message when the job cannot go on (some unit lost every copy, or no quorum)."""
    cfg = load_config(config, overrides)
    host, port = store.rsplit(":", 1)
    try:
        run_resilient_worker(cfg, Path(cfg.metrics.run_dir) / "resilient" / "launch.json", worker, world, host,
                             int(port), joining)
    except (ValueError, RuntimeError) as exc:  # LostUnitsError, NoQuorumError
        print(f"plait launch: worker {worker} stops: {exc}", file=sys.stderr, flush=True)
        _exit_now(3)
    _exit_now(0)
    return 0


def _exit_now(code: int) -> None:
    """End the worker process at once: its work is saved and its groups closed, but the interpreter's shutdown
    waits about the collective timeout on the gloo contexts of groups whose peers already left."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
