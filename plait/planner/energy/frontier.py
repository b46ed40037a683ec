"""The time-energy frontier of a pipeline schedule: one GPU frequency per action (Perseus).

Perseus (Chung et al., SOSP 2024, arXiv 2312.06902) turns one iteration of a
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
   fails on two or three options), and the discrete problem is NP-hard, which its min-cut steps do not solve
   exactly. So every assignment lowtime visits is re-timed exactly (:meth:`EnergyDag.evaluate`), then
   *polished*: greedy sweeps over the DAG give actions the cheapest option that fits their slack without moving
   the iteration end (:meth:`EnergyDag.polish`). Added candidates: the all-top-clock assignment polished (the
   ``T*`` candidate) and uniformly *stretched* ones (:meth:`EnergyDag.stretched`). On request the points at
   ``T*`` and at given deadlines (a straggler's time) are refined by a MILP warm-started from the best point
   (``energy_exact.best_within``, HiGHS, time-limited); small DAGs get the exact frontier by MILP
   (``energy_exact.exact_choices``, ``method="exact"``). Dominated candidates are dropped.
3. :func:`energy_plan`: the frontier as the shared plan file (``planner.energy_plan.EnergyPlan``): per point
   the actions not at the top clock; :func:`replay_plan` replays a point through the simulator (time and
   energy) and returns its timeline with each action's frequency.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from plait.planner.energy.types import ActionFrequency, EnergyPlan, FrontierPoint, action_label
from plait.planner.energy.power_profile import ActionOption
from plait.planner.pipeline.schedule_ir import Action, Schedule, check_schedule, schedule_dag
from plait.planner.pipeline.simulator import simulate
from plait.planner.pipeline.types import P2PModel, SimResult

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
    _succs: list[list[tuple[int, float]]] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def fastest(self) -> tuple[int, ...]:
        """Every action at its fastest option (index 0; the top clock among equally fast ones)."""
        return (0,) * len(self.actions)

    @property
    def top_clock(self) -> tuple[int, ...]:
        """Every action at its highest frequency: the iteration without any frequency plan."""
        return tuple(max(range(len(o)), key=lambda i: (o[i][0], -o[i][1])) for o in self.options)

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

    def polish(self, choice: Sequence[int], deadline: float, rounds: int = 1) -> tuple[int, ...]:
        """``choice`` with actions moved to their cheapest option (least ``e - P_blocking t``) that fits their
        slack, so that the iteration still ends by ``deadline`` (which ``choice`` must meet). Rounds of two greedy
        sweeps (at most ``rounds``, until a round gains nothing), the cheaper result kept: in reverse topological order (an action may last until the latest start of its
        already settled successors; its predecessors keep their times and later use the slack left) and in
        topological order (an action starts when its settled predecessors end and may last until the latest
        start its successors allow at their current times)."""
        best, energy = tuple(choice), self.evaluate(choice)[1]
        for _ in range(rounds):  # sweeps from the best so far, until one round gains nothing
            late = self._sweep(best, deadline, backward=True)
            early = self._sweep(late, deadline, backward=False)
            found = min((late, early), key=lambda c: self.evaluate(c)[1])
            found_energy = self.evaluate(found)[1]
            if found_energy >= energy * (1 - 1e-12):
                break
            best, energy = found, found_energy
        return best

    def _sweep(self, choice: Sequence[int], deadline: float, backward: bool) -> tuple[int, ...]:
        succs = self._successors()
        out = list(choice)
        slack = 1e-12 * max(1.0, deadline)
        if backward:
            ends = self.finish_times(out)
            latest_start = [0.0] * len(out)
            for v in range(len(out) - 1, -1, -1):
                latest_end = min((latest_start[w] - d for w, d in succs[v]), default=deadline)
                out[v] = self._cheapest(v, out[v], latest_end - (ends[v] - self.options[v][out[v]][1]) + slack)
                latest_start[v] = latest_end - self.options[v][out[v]][1]
            return tuple(out)
        latest_start = self._latest_starts(out, deadline)
        ends = [0.0] * len(out)
        for v, preds in enumerate(self.preds):
            start = max((ends[u] + d for u, d in preds), default=0.0)
            latest_end = min((latest_start[w] - d for w, d in succs[v]), default=deadline)
            out[v] = self._cheapest(v, out[v], latest_end - start + slack)
            ends[v] = start + self.options[v][out[v]][1]
        return tuple(out)

    def stretched(self, factor: float) -> tuple[int, ...]:
        """Every action at its cheapest option lasting at most ``factor`` times its top-clock time: an assignment
        whose iteration ends by ``factor`` times the top-clock one (transfers do not stretch), Perseus' uniform
        answer to a straggler, which the polish and the solver then improve."""
        top = self.top_clock
        return tuple(self._cheapest(v, top[v], factor * self.options[v][top[v]][1] * (1 + 1e-12))
                     for v in range(len(self.options)))

    def _cheapest(self, v: int, current: int, window: float) -> int:
        """The option of node ``v`` with the least effective cost among those lasting at most ``window``
        seconds (``current`` when none is cheaper)."""
        best = current
        for i, (_, t, _) in enumerate(self.options[v]):
            if t <= window and self._effective(v, i) < self._effective(v, best):
                best = i
        return best

    def _latest_starts(self, choice: Sequence[int], deadline: float) -> list[float]:
        """Per node, the latest start that keeps every successor (at its time in ``choice``) within ``deadline``."""
        succs = self._successors()
        latest = [0.0] * len(choice)
        for v in range(len(choice) - 1, -1, -1):
            latest_end = min((latest[w] - d for w, d in succs[v]), default=deadline)
            latest[v] = latest_end - self.options[v][choice[v]][1]
        return latest

    def _successors(self) -> list[list[tuple[int, float]]]:
        if self._succs is None:
            succs: list[list[tuple[int, float]]] = [[] for _ in self.actions]
            for v, preds in enumerate(self.preds):
                for u, d in preds:
                    succs[u].append((v, d))
            self._succs = succs
        return self._succs

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
    out = sorted(((int(f), float(t), float(e)) for f, t, e in raw), key=lambda o: (o[1], -o[0]))
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
                    exact_max_options: int = 64, deadlines: Sequence[float] = (), max_slowdown: float | None = None,
                    refine_s: float = 0.0) -> list[FrontierCandidate]:
    """The time-energy frontier of ``dag`` (module docstring, step 2), sorted by time, fastest first.

    Args:
        method: ``"lowtime"`` (lowtime's Phillips-Dessouky solver, then exact re-timing and polishing),
            ``"exact"`` (``energy_exact.exact_choices``: a MILP per point, exact, for small DAGs) or ``"auto"``
            (exact when the DAG has at most ``exact_max_options`` options in all, else lowtime).
        steps: time quanta between the slowest and the fastest iteration (lowtime's ``unit_time`` is that
            span divided by ``steps``); more is finer and slower.
        time_limit_s: stop tracing after this many seconds (the points found so far are kept).
        deadlines: iteration times (s) that must get their own point (e.g. a straggler's): the best point within
            each is polished up to it.
        max_slowdown: lowtime traces only with options at most this many times slower than each action's fastest
            (the frontier's fast part, where plans are chosen, in fewer steps); polishing and refining use all.
        refine_s: seconds of MILP (``energy_exact.best_within``, warm-started from the best point found) spent on
            the point at ``T*`` and on each deadline's point after lowtime; 0: none.

    Returns:
        Pareto-optimal candidates (no other candidate is as fast and cheaper); the first is at the all-top-clock
        iteration time ``T*`` (the fastest possible when every action's top clock is its fastest option).

    Raises:
        ValueError: on an unknown method or a ``max_slowdown`` below 1.
    """
    if method not in ("auto", "exact", "lowtime"):
        raise ValueError(f"energy_frontier method must be 'auto', 'exact' or 'lowtime', got {method!r}")
    if max_slowdown is not None and not max_slowdown >= 1:
        raise ValueError(f"max_slowdown must be >= 1, got {max_slowdown}")
    if method == "auto":
        method = "exact" if sum(len(o) for o in dag.options) <= exact_max_options else "lowtime"
    top_time, _ = dag.evaluate(dag.top_clock)
    candidates = {dag.polish(dag.top_clock, top_time, rounds=4)}
    for factor in _stretch_factors(max_slowdown, [d / top_time for d in deadlines if top_time > 0]):
        stretched = dag.stretched(factor)
        candidates.add(dag.polish(stretched, dag.evaluate(stretched)[0]))
    if method == "exact":
        from plait.planner.energy.exact import exact_choices

        candidates.update(exact_choices(dag, time_limit_s=time_limit_s))
    else:
        for choice in _lowtime_choices(dag, steps, time_limit_s, max_slowdown):
            candidates.add(choice)
            deadline, _ = dag.evaluate(choice)
            candidates.add(dag.polish(choice, deadline))
    front = _fill(dag, [FrontierCandidate(*dag.evaluate(c), c) for c in candidates], deadlines)
    return _refine(dag, front, [top_time, *deadlines], refine_s) if refine_s > 0 and method != "exact" else front


def _stretch_factors(max_slowdown: float | None, extra: Sequence[float], count: int = 8) -> list[float]:
    """Slowdown factors of the stretched candidates (``EnergyDag.stretched``): ``count`` evenly from 1 to
    ``max_slowdown`` (1.5 when None) and each of ``extra``."""
    top = 1.5 if max_slowdown is None else max_slowdown
    return [1 + (top - 1) * i / (count - 1) for i in range(count)] + [f for f in extra if f >= 1]


def _refine(dag: EnergyDag, front: list[FrontierCandidate], targets: Sequence[float],
            seconds: float) -> list[FrontierCandidate]:
    """``front`` with, for each target time, the MILP's least-energy assignment within it (``seconds`` each),
    warm-started from the front's best point within it."""
    from plait.planner.energy.exact import best_within

    extra = []
    for target in targets:
        within = [c for c in front if c.time_s <= target * (1 + 1e-12)]
        if not within:
            continue
        start = min(within, key=lambda c: c.energy_j).choice
        found = best_within(dag, target * (1 + 1e-12), start=start, time_limit_s=seconds)
        if found is not None:
            extra.append(FrontierCandidate(*dag.evaluate(found), found))
    return _pareto(list(front) + extra)


def _fill(dag: EnergyDag, candidates: Sequence[FrontierCandidate], deadlines: Sequence[float]) -> list[FrontierCandidate]:
    """The Pareto set of ``candidates`` after polishing each frontier point up to the next point's time (a point
    may use the time the next one takes) and, for each of ``deadlines``, the best point within it up to it."""
    front = _pareto(candidates)
    extra = [FrontierCandidate(*dag.evaluate(c), c)
             for c in (dag.polish(a.choice, b.time_s) for a, b in zip(front, front[1:]))]
    front = _pareto(list(front) + extra)
    for deadline in deadlines:
        within = [c for c in front if c.time_s <= deadline]
        if within:
            best = dag.polish(min(within, key=lambda c: c.energy_j).choice, deadline, rounds=4)
            front = _pareto(list(front) + [FrontierCandidate(*dag.evaluate(best), best)])
    return front


def _pareto(candidates: Sequence[FrontierCandidate]) -> list[FrontierCandidate]:
    """The candidates no other beats on both time and energy, by time (ties: the cheaper)."""
    out: list[FrontierCandidate] = []
    for cand in sorted(candidates, key=lambda c: (c.time_s, c.energy_j)):
        if not out or cand.energy_j < out[-1].energy_j * (1 - 1e-12):
            out.append(cand)
    return out


def _lowtime_choices(dag: EnergyDag, steps: int, time_limit_s: float, max_slowdown: float | None):
    """Option indices per node at every Phillips-Dessouky iteration (lowtime), slowest first; only options at most
    ``max_slowdown`` times slower than the node's fastest are offered (all when None)."""
    import networkx as nx
    from lowtime.graph_utils import add_sink_node, add_source_node
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, Operation, OperationSpec
    from lowtime.solver import PhillipsDessouky

    allowed = [[i for i, (_, t, _) in enumerate(o) if max_slowdown is None or t <= max_slowdown * o[0][1]]
               for o in dag.options]
    slow_time, _ = dag.evaluate(tuple(a[-1] for a in allowed))
    fast_time, _ = dag.evaluate(dag.fastest)
    if slow_time <= fast_time or all(len(a) == 1 for a in allowed):
        return
    unit = (slow_time - fast_time) / max(1, steps)
    scale = _cost_scale(dag, unit)
    graph = nx.DiGraph()
    for v, options in enumerate(dag.options):
        opts = [ExecutionOption(real_time=options[i][1], unit_time=unit,
                                cost=scale * (options[i][2] - dag.blocking_w * options[i][1]), knob=i)
                for i in allowed[v]]
        graph.add_node(v, op=Operation(spec=_spec(opts, CandidateExecutionOptions, OperationSpec)))
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
        yield tuple(graph.nodes[v]["op"].assigned_knob for v in range(len(dag.options)))
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
                max_points: int = 64, keep: Sequence[float] = ()) -> EnergyPlan:
    """The frontier as the shared plan file: at most ``max_points`` points (the fastest, the slowest and points
    spread evenly in time between, plus for each time in ``keep`` the least-energy point within it), each listing
    the actions whose frequency is not ``max_frequency_mhz``."""
    chosen = set(_thin(frontier, max_points))
    for limit in keep:
        within = [c for c in frontier if c.time_s <= limit * (1 + 1e-12)]
        if within:
            chosen.add(min(within, key=lambda c: c.energy_j))
    points = []
    for cand in sorted(chosen, key=lambda c: (c.time_s, c.energy_j)):
        freqs = tuple(ActionFrequency(rank, action_label(a.kind, a.stage, a.microbatch), dag.options[v][c][0])
                      for v, ((rank, a), c) in enumerate(zip(dag.actions, cand.choice))
                      if dag.options[v][c][0] != max_frequency_mhz)
        points.append(FrontierPoint(cand.time_s, cand.energy_j, freqs))
    schedule = tuple(f"{rank} {action_label(a.kind, a.stage, a.microbatch)}" for rank, a in dag.actions)
    return EnergyPlan(gpu, int(max_frequency_mhz), tuple(points), schedule)


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
