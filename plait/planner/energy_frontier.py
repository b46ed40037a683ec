"""The time-energy frontier of a pipeline schedule: one GPU frequency per action (Perseus, issue 17).

Perseus (Chung et al., SOSP 2024, arXiv 2312.06902; ../shared/REFERENCES.md section 4) turns one iteration of a
pipeline schedule into a DAG of computations, each with its (time, energy) options per SM frequency, and
traces the DAG's time-energy Pareto frontier; the fastest point removes *intrinsic* bloat (computations off the
critical path slowed down, iteration time unchanged) and the point at a straggler's iteration time ``T'``
removes *extrinsic* bloat. Energy of an iteration on ``R`` GPUs with iteration time ``T``:
``sum_i e_i + P_blocking * (R * T - sum_i t_i)`` (a GPU draws ``P_blocking`` whenever it waits).

Steps, for any of plait's schedules (``schedule_ir.Schedule``: 1F1B, interleaved, GPipe, split backward; one
pipeline replica, every replica runs the same plan):

1. :func:`schedule_energy_dag`: one node per action with its options, edges from ``schedule_ir.schedule_dag``
   (the rank's order and the data dependencies), a cross-rank edge carrying the P2P time of the simulator
   (``P2PModel.transfer_s`` of the sending stage's boundary bytes), exactly the simulator's timing model.
2. :func:`energy_frontier`: ``lowtime``'s Phillips-Dessouky solver (PyPI ``lowtime``, the Perseus authors'
   solver) traces the frontier on the DAG with each action's *effective* cost ``e - P_blocking * t`` (so that
   the total is the iteration energy up to ``P_blocking * R * T``), P2P delays as nodes with one option.
   What lowtime cannot express exactly, and how it is handled: it works on integer time quanta
   (``unit_time``) and interpolates between the discrete frequencies with a continuous cost model (here the
   lower convex hull of each action's options, :class:`_HullModel`, instead of its exponential fit, which
   fails on two or three options). So every assignment lowtime visits is re-timed exactly
   (:meth:`EnergyDag.evaluate`), then *polished*: one backward pass over the DAG gives each action the
   cheapest option that fits its slack without moving the iteration end (:meth:`EnergyDag.polish`). The
   all-top-frequency assignment is polished too (the ``T*`` candidate). Dominated candidates are dropped.
3. :func:`energy_plan`: the frontier as the shared plan file (``planner.energy_plan.EnergyPlan``): per point
   the actions not at the top clock; :func:`replay_plan` replays a point through the simulator (time and
   energy) and returns its timeline with each action's frequency.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from plait.planner.energy_plan import ActionFrequency, EnergyPlan, FrontierPoint, action_label
from plait.planner.energy_profile import ActionOption
from plait.planner.schedule_ir import Action, Schedule, check_schedule, schedule_dag
from plait.planner.simulator import P2PModel, SimResult, simulate

__all__ = [
    "EnergyDag",
    "FrontierCandidate",
    "energy_at_deadline",
    "energy_frontier",
    "energy_plan",
    "replay_plan",
    "schedule_energy_dag",
]

OptionsOf = Callable[[Action], Sequence[ActionOption]] | Mapping[tuple[int, str], Sequence[ActionOption]]
"""Options of an action: a callable ``action -> [(frequency_mhz, seconds, joules), ...]`` or a mapping
``{(stage, kind): options}`` (the same for every microbatch; ``energy_profile.stage_action_options``)."""


@dataclass(frozen=True)
class FrontierCandidate:
    """One assignment of options to the DAG's nodes with its exact iteration time (s) and energy (J)."""

    time_s: float
    energy_j: float
    choice: tuple[int, ...]


@dataclass
class EnergyDag:
    """One iteration as a DAG of actions with options (module docstring, step 1).

    Attributes:
        actions: per node, ``(rank, Action)``, in a topological order (every predecessor comes first).
        options: per node, its options ``(frequency_mhz, seconds, joules)``, fastest first.
        preds: per node, ``(predecessor node, delay seconds)``: the delay is the P2P transfer across ranks.
        num_ranks: GPUs of the pipeline (``R``).
        blocking_w: power of a waiting GPU (W).
    """

    actions: list[tuple[int, Action]]
    options: list[list[ActionOption]]
    preds: list[list[tuple[int, float]]]
    num_ranks: int
    blocking_w: float

    @property
    def fastest(self) -> tuple[int, ...]:
        """Every action at its fastest option (index 0)."""
        return (0,) * len(self.actions)

    def finish_times(self, choice: Sequence[int]) -> list[float]:
        """Per node, when it ends with the options ``choice`` (each starts when its predecessors and their P2P
        transfers are done: the simulator's model)."""
        ends = [0.0] * len(self.actions)
        for v, preds in enumerate(self.preds):
            start = max((ends[u] + d for u, d in preds), default=0.0)
            ends[v] = start + self.options[v][choice[v]][1]
        return ends

    def evaluate(self, choice: Sequence[int]) -> tuple[float, float]:
        """``(iteration seconds, joules)`` of ``choice``: energy ``sum e + P_blocking (R T - sum t)``."""
        makespan = max(self.finish_times(choice), default=0.0)
        busy = sum(self.options[v][c][1] for v, c in enumerate(choice))
        energy = sum(self.options[v][c][2] for v, c in enumerate(choice))
        return makespan, energy + self.blocking_w * (self.num_ranks * makespan - busy)

    def polish(self, choice: Sequence[int], deadline: float) -> tuple[int, ...]:
        """``choice`` with each action moved to its cheapest option (least ``e - P_blocking t``) that fits its
        slack, so that the iteration still ends by ``deadline`` (which ``choice`` must meet). One pass in reverse
        topological order: an action may take until the latest start of its successors, its predecessors keep
        their times (they are visited later and only use the slack left)."""
        ends = self.finish_times(choice)
        succs: list[list[tuple[int, float]]] = [[] for _ in self.actions]
        for v, preds in enumerate(self.preds):
            for u, d in preds:
                succs[u].append((v, d))
        latest_start = [0.0] * len(self.actions)
        out = list(choice)
        for v in range(len(self.actions) - 1, -1, -1):
            latest_end = min((latest_start[w] - d for w, d in succs[v]), default=deadline)
            start = ends[v] - self.options[v][out[v]][1]
            window = latest_end - start + 1e-12 * max(1.0, deadline)
            best = out[v]
            for i, (_, t, e) in enumerate(self.options[v]):
                if t <= window and e - self.blocking_w * t < self._effective(v, best):
                    best = i
            out[v] = best
            latest_start[v] = latest_end - self.options[v][best][1]
        return tuple(out)

    def _effective(self, v: int, i: int) -> float:
        _, t, e = self.options[v][i]
        return e - self.blocking_w * t


def schedule_energy_dag(schedule: Schedule, options_of: OptionsOf, *, p2p: P2PModel | None = None,
                        boundary_bytes: Mapping[int, float] | None = None, blocking_w: float = 0.0) -> EnergyDag:
    """The ``EnergyDag`` of one iteration of ``schedule`` (module docstring, step 1).

    Args:
        schedule: a checked schedule (``check_schedule`` runs first).
        options_of: the options of each action (``OptionsOf``).
        p2p, boundary_bytes: the simulator's transfer model: stage ``s``'s output (and its gradient) takes
            ``p2p.transfer_s(boundary_bytes[s])`` between ranks.
        blocking_w: power of a waiting GPU (W).

    Raises:
        ValueError: on a schedule that fails ``check_schedule``, an action without options or with a negative
            time or energy, or a ``p2p`` with host message overheads (not modelled here: GPU presets have none).
    """
    check_schedule(schedule)
    p2p = p2p or P2PModel()
    if p2p.send_overhead_s or p2p.recv_overhead_s:
        raise ValueError("the energy DAG does not model host message overheads (P2PModel send/recv_overhead_s); "
                         "plan energy with a GPU link model")
    plan = schedule.plan
    send = [p2p.transfer_s((boundary_bytes or {}).get(s, 0)) for s in range(plan.num_stages)]
    deps = schedule_dag(schedule)
    order = _topological(deps)
    index = {a: i for i, a in enumerate(order)}
    rank_of = {a: r for r, a in schedule.all_actions()}
    actions, options, preds = [], [], []
    for action in order:
        actions.append((rank_of[action], action))
        options.append(_options(options_of, action))
        preds.append([(index[dep], _delay(plan, dep, action, send)) for dep in deps[action]])
    return EnergyDag(actions, options, preds, schedule.num_ranks, float(blocking_w))


def _delay(plan, dep: Action, action: Action, send: Sequence[float]) -> float:
    """P2P seconds on the edge ``dep -> action``: the simulator's ``send_s`` of the boundary crossed when the two
    stages sit on different ranks (the forward output of ``dep``'s stage, or the gradient of ``action``'s)."""
    if plan.stages[dep.stage].rank == plan.stages[action.stage].rank:
        return 0.0
    return send[dep.stage] if action.kind == "F" else send[action.stage]


def _options(options_of: OptionsOf, action: Action) -> list[ActionOption]:
    raw = options_of(action) if callable(options_of) else options_of.get((action.stage, action.kind))
    if not raw:
        raise ValueError(f"no frequency options for {action}")
    out = sorted(((int(f), float(t), float(e)) for f, t, e in raw), key=lambda o: (o[1], o[2]))
    if any(t < 0 or e < 0 for _, t, e in out):
        raise ValueError(f"{action}: option times and energies must be >= 0, got {out}")
    return out


def _topological(deps: Mapping[Action, Sequence[Action]]) -> list[Action]:
    """Kahn's order of the schedule DAG (ties by rank order of insertion)."""
    remaining = {a: len(d) for a, d in deps.items()}
    users: dict[Action, list[Action]] = {a: [] for a in deps}
    for a, d in deps.items():
        for dep in d:
            users[dep].append(a)
    ready = [a for a, n in remaining.items() if n == 0]
    order = []
    while ready:
        a = ready.pop()
        order.append(a)
        for user in users[a]:
            remaining[user] -= 1
            if remaining[user] == 0:
                ready.append(user)
    return order


# ----- lowtime ---------------------------------------------------------------------------------------------
def energy_frontier(dag: EnergyDag, *, method: str = "auto", steps: int = 400, time_limit_s: float = 300.0,
                    exact_max_options: int = 256) -> list[FrontierCandidate]:
    """The time-energy frontier of ``dag`` (module docstring, step 2), sorted by time, fastest first.

    Args:
        method: ``"lowtime"`` (lowtime's Phillips-Dessouky solver, then exact re-timing and polishing),
            ``"exact"`` (``energy_exact.exact_choices``: a MILP per point, exact, for small DAGs) or ``"auto"``
            (exact when the DAG has at most ``exact_max_options`` options in all, else lowtime).
        steps: time quanta between the slowest and the fastest iteration (lowtime's ``unit_time`` is that
            span divided by ``steps``); more is finer and slower.
        time_limit_s: stop tracing after this many seconds (the points found so far are kept).

    Returns:
        Pareto-optimal candidates (no other candidate is as fast and cheaper); the first is at the all-top-clock
        iteration time ``T*``.

    Raises:
        ValueError: on an unknown method.
    """
    if method not in ("auto", "exact", "lowtime"):
        raise ValueError(f"energy_frontier method must be 'auto', 'exact' or 'lowtime', got {method!r}")
    if method == "auto":
        method = "exact" if sum(len(o) for o in dag.options) <= exact_max_options else "lowtime"
    fastest_time, _ = dag.evaluate(dag.fastest)
    candidates = {dag.polish(dag.fastest, fastest_time)}
    if method == "exact":
        from plait.planner.energy_exact import exact_choices

        candidates.update(exact_choices(dag, time_limit_s=time_limit_s))
    else:
        for choice in _lowtime_choices(dag, steps, time_limit_s):
            candidates.add(choice)
            deadline, _ = dag.evaluate(choice)
            candidates.add(dag.polish(choice, deadline))
    scored = [FrontierCandidate(*dag.evaluate(c), c) for c in candidates]
    return _pareto(scored)


def _pareto(candidates: Sequence[FrontierCandidate]) -> list[FrontierCandidate]:
    """The candidates no other beats on both time and energy, by time (ties: the cheaper)."""
    out: list[FrontierCandidate] = []
    for cand in sorted(candidates, key=lambda c: (c.time_s, c.energy_j)):
        if not out or cand.energy_j < out[-1].energy_j * (1 - 1e-12):
            out.append(cand)
    return out


def _lowtime_choices(dag: EnergyDag, steps: int, time_limit_s: float):
    """Option indices per node at every Phillips-Dessouky iteration (lowtime), slowest first."""
    import networkx as nx
    from lowtime.graph_utils import add_sink_node, add_source_node
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, Operation, OperationSpec
    from lowtime.solver import PhillipsDessouky

    slow_time, _ = dag.evaluate(tuple(len(o) - 1 for o in dag.options))
    fast_time, _ = dag.evaluate(dag.fastest)
    if slow_time <= fast_time or all(len(o) == 1 for o in dag.options):
        return
    unit = (slow_time - fast_time) / max(1, steps)
    scale = _cost_scale(dag, unit)
    graph = nx.DiGraph()
    knob_index = []
    for v, options in enumerate(dag.options):
        opts = [ExecutionOption(real_time=t, unit_time=unit, cost=scale * (e - dag.blocking_w * t), knob=i)
                for i, (_, t, e) in enumerate(options)]
        graph.add_node(v, op=Operation(spec=_spec(opts, CandidateExecutionOptions, OperationSpec)))
        knob_index.append(v)
    extra = len(dag.options)
    for v, preds in enumerate(dag.preds):
        for u, delay in preds:
            if delay > 0:
                fixed = [ExecutionOption(real_time=delay, unit_time=unit, cost=0.0, knob=0)]
                graph.add_node(extra, op=Operation(spec=_spec(fixed, CandidateExecutionOptions, OperationSpec)))
                graph.add_edge(u, extra)
                graph.add_edge(extra, v)
                extra += 1
            else:
                graph.add_edge(u, v)
    add_source_node(graph, extra)
    add_sink_node(graph, extra + 1)
    graph.graph["source_node"], graph.graph["sink_node"] = extra, extra + 1
    start = time.perf_counter()
    for _ in PhillipsDessouky(graph).run():
        yield tuple(graph.nodes[v]["op"].assigned_knob for v in knob_index)
        if time.perf_counter() - start > time_limit_s:
            return


def _cost_scale(dag: EnergyDag, unit: float) -> float:
    """A factor bringing the largest cost change per time quantum near 100: lowtime's flow capacities treat
    10,000 as infinite and round to 1e-6 (solver.annotate_capacities)."""
    slope = 0.0
    for options in dag.options:
        for (_, t0, e0), (_, t1, e1) in zip(options, options[1:]):
            if t1 > t0:
                slope = max(slope, abs((e1 - dag.blocking_w * t1) - (e0 - dag.blocking_w * t0)) / (t1 - t0))
    return 100.0 / (slope * unit) if slope > 0 else 1.0


def _spec(options, candidate_cls, spec_cls):
    candidates = candidate_cls(options=options)
    return spec_cls(options=candidates, cost_model=_HullModel(candidates))


class _HullModel:
    """lowtime cost model: the lower convex hull of the candidate options' ``(quant_time, cost)`` points,
    linear in between, constant outside (lowtime's ``CostModel`` protocol: called with a quantized time)."""

    def __init__(self, candidates) -> None:
        points = sorted({(o.quant_time, o.cost) for o in candidates.options})
        hull: list[tuple[float, float]] = []
        for p in points:
            if hull and hull[-1][0] == p[0]:
                if p[1] >= hull[-1][1]:
                    continue
                hull.pop()
            while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
                hull.pop()
            hull.append(p)
        self.hull = hull

    def __call__(self, quant_time: float) -> float:
        hull = self.hull
        if quant_time <= hull[0][0]:
            return hull[0][1]
        for (t0, c0), (t1, c1) in zip(hull, hull[1:]):
            if quant_time <= t1:
                return c0 + (c1 - c0) * (quant_time - t0) / (t1 - t0)
        return hull[-1][1]


def _cross(o: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


# ----- the plan file and its replay --------------------------------------------------------------------------
def energy_plan(dag: EnergyDag, frontier: Sequence[FrontierCandidate], gpu: str, max_frequency_mhz: int, *,
                max_points: int = 64) -> EnergyPlan:
    """The frontier as the shared plan file: at most ``max_points`` points (the fastest, the slowest and points
    spread evenly in time between), each listing the actions whose frequency is not ``max_frequency_mhz``."""
    chosen = _thin(frontier, max_points)
    points = []
    for cand in chosen:
        freqs = tuple(ActionFrequency(rank, action_label(a.kind, a.stage, a.microbatch), dag.options[v][c][0])
                      for v, ((rank, a), c) in enumerate(zip(dag.actions, cand.choice))
                      if dag.options[v][c][0] != max_frequency_mhz)
        points.append(FrontierPoint(cand.time_s, cand.energy_j, freqs))
    return EnergyPlan(gpu, int(max_frequency_mhz), tuple(points))


def _thin(frontier: Sequence[FrontierCandidate], limit: int) -> list[FrontierCandidate]:
    if len(frontier) <= limit:
        return list(frontier)
    picks = {round(i * (len(frontier) - 1) / (limit - 1)) for i in range(limit)}
    return [frontier[i] for i in sorted(picks)]


def energy_at_deadline(point: FrontierPoint, deadline_s: float, num_ranks: int, blocking_w: float) -> float:
    """Joules of an iteration run at ``point`` when the pipeline must wait until ``deadline_s`` anyway (a
    straggler replica): the point's energy plus ``P_blocking`` on every GPU for ``deadline_s - time``."""
    return point.energy_j + blocking_w * num_ranks * max(0.0, deadline_s - point.iteration_time_s)


def replay_plan(schedule: Schedule, options_of: OptionsOf, plan: EnergyPlan, point: FrontierPoint, *,
                p2p: P2PModel | None = None, boundary_bytes: Mapping[int, float] | None = None,
                blocking_w: float = 0.0) -> tuple[SimResult, float, dict[tuple[int, str], int]]:
    """Replay ``point`` of ``plan`` through the simulator (``simulator.simulate``).

    Returns:
        ``(result, joules, frequencies)``: the simulated iteration, its energy ``sum e + P_blocking (R T - sum t)``
        and ``{(rank, label): frequency_mhz}`` of every action (the top clock where the point lists none).

    Raises:
        ValueError: when a planned frequency is not among the action's options, and as ``simulate``.
    """
    rank_of = {a: r for r, a in schedule.all_actions()}
    chosen: dict[Action, ActionOption] = {}
    for action, rank in rank_of.items():
        label = action_label(action.kind, action.stage, action.microbatch)
        frequency = plan.frequency_of(point, rank, label)
        match = [o for o in _options(options_of, action) if o[0] == frequency]
        if not match:
            raise ValueError(f"rank {rank} {label}: planned frequency {frequency} MHz has no option")
        chosen[action] = match[0]
    result = simulate(schedule, lambda s, k, m: chosen[Action(k, s, m)][1], p2p=p2p, boundary_bytes=boundary_bytes)
    busy = sum(o[1] for o in chosen.values())
    energy = sum(o[2] for o in chosen.values()) + blocking_w * (schedule.num_ranks * result.makespan_s - busy)
    freqs = {(rank_of[a], action_label(a.kind, a.stage, a.microbatch)): o[0] for a, o in chosen.items()}
    return result, energy, freqs
