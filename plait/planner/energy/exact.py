"""The exact time-energy frontier of a small energy DAG, by mixed-integer programming (HiGHS).

``lowtime``'s Phillips-Dessouky solver (``planner.energy_frontier``) is exact for continuous, convex
time-cost trade-offs; with a handful of discrete GPU frequencies per action the trade-off is the discrete
time-cost problem, which is NP-hard (De et al., "Complexity of the discrete time-cost tradeoff problem for
project networks", Operations Research 45(2), 1997), so its points can be dominated. For DAGs small enough
this module gives the frontier exactly, by the epsilon-constraint method: minimise the iteration energy under
an iteration-time bound, read the optimum's exact time ``t``, tighten the bound just below ``t`` and repeat
until no assignment meets it. Each solve is one MILP (``highspy``, already a plait dependency):

- ``x[v, i]`` binary, node ``v`` runs option ``i``; ``sum_i x[v, i] = 1``;
- ``s[v] >= 0`` its start; for an edge ``u -> v`` with P2P delay ``d``: ``s[v] >= s[u] + sum_i t[u, i] x[u, i] + d``;
- ``T >= s[v] + sum_i t[v, i] x[v, i]`` for every ``v``, ``T <= bound``;
- minimise ``sum (e[v, i] - P_blocking t[v, i]) x[v, i] + P_blocking R T`` (the iteration energy).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["best_within", "exact_choices", "quiet_highs"]


def exact_choices(dag: Any, *, time_limit_s: float = 60.0, max_points: int = 10_000) -> list[tuple[int, ...]]:
    """Option indices of every frontier point of ``dag`` (an ``energy_frontier.EnergyDag``), slowest first
    (module docstring).

    Args:
        time_limit_s: stop after this many seconds (the points found so far are returned).
        max_points: stop after this many points.

    Raises:
        ValueError: when the DAG has no node.
    """
    import highspy

    if not dag.options:
        raise ValueError("the energy DAG has no action")
    h, columns = _model(dag, highspy)
    out: list[tuple[int, ...]] = []
    bound = highspy.kHighsInf
    start = time.perf_counter()
    t_col = columns["T"]
    while len(out) < max_points and time.perf_counter() - start < time_limit_s:
        h.changeColBounds(t_col, 0.0, bound)
        h.setOptionValue("time_limit", max(1e-3, time_limit_s - (time.perf_counter() - start)))
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            break
        values = np.asarray(h.getSolution().col_value)
        choice = tuple(int(np.argmax(values[cols])) for cols in columns["x"])
        makespan, _ = dag.evaluate(choice)
        out.append(choice)
        bound = makespan * (1 - 1e-7) - 1e-12
    return out


def best_within(dag: Any, bound_s: float, *, start: tuple[int, ...] | None = None,
                time_limit_s: float = 10.0) -> tuple[int, ...] | None:
    """Option indices of the least-energy assignment of ``dag`` whose iteration ends by ``bound_s`` (one MILP of the
    module docstring), warm-started from ``start`` (an assignment meeting the bound); at the time limit the best
    assignment found (HiGHS' incumbent). None when there is none (the bound is below the fastest iteration or no
    solution came in time)."""
    import highspy

    h, columns = _model(dag, highspy)
    h.changeColBounds(columns["T"], 0.0, float(bound_s))
    h.setOptionValue("time_limit", float(time_limit_s))
    if start is not None:
        h.setSolution(_solution(dag, columns, start, highspy))
    h.run()
    values = np.asarray(h.getSolution().col_value)
    if values.size != columns["T"] + 1 or h.getInfo().primal_solution_status != 2:
        return None
    return tuple(int(np.argmax(values[cols])) for cols in columns["x"])


def _solution(dag: Any, columns: dict[str, Any], choice: tuple[int, ...], highspy: Any) -> Any:
    """A HiGHS solution of the model for ``choice``: its options, earliest starts and iteration time."""
    ends = dag.finish_times(choice)
    x = np.zeros(columns["T"] + 1)
    for v, c in enumerate(choice):
        x[columns["x"][v][c]] = 1.0
        x[columns["s"][v]] = ends[v] - dag.options[v][c][1]
    x[columns["T"]] = max(ends, default=0.0)
    solution = highspy.HighsSolution()
    solution.col_value = x.tolist()
    return solution


def quiet_highs(highspy: Any) -> Any:
    """A HiGHS solver that prints nothing, not even its banner.

    HiGHS prints ``Running HiGHS ...`` at the first call on an instance unless ``output_flag`` is already false
    (ERGO-Code/HiGHS#1702: set it before calling any other method), and ``highspy.Highs()`` itself makes such a call
    (it enables its callbacks) before the caller can set the option. So the solver is built from the class
    ``highspy.Highs`` extends (the HiGHS binding, which has every method used here: options, model edits, ``run``,
    solutions), silenced first, and returned; plait uses no highspy callback.
    """
    binding = next(c for c in highspy.Highs.__mro__[1:] if hasattr(c, "run") and hasattr(c, "setOptionValue"))
    h = binding()
    h.setOptionValue("output_flag", False)
    return h


def _model(dag: Any, highspy: Any) -> tuple[Any, dict[str, Any]]:
    """The MILP of the module docstring without the time bound; columns: ``x`` (per node, its option columns),
    ``s`` (per node, its start column) and ``T``."""
    inf = highspy.kHighsInf
    x_cols, col = [], 0
    for options in dag.options:
        x_cols.append(np.arange(col, col + len(options), dtype=np.int32))
        col += len(options)
    s_cols = np.arange(col, col + len(dag.options), dtype=np.int32)
    t_col = col + len(dag.options)
    n = t_col + 1
    cost = np.zeros(n)
    for v, options in enumerate(dag.options):
        cost[x_cols[v]] = [e - dag.blocking_w * t for _, t, e in options]
    cost[t_col] = dag.blocking_w * dag.num_ranks
    h = quiet_highs(highspy)
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", 1e-9)
    upper = np.r_[np.ones(col), np.full(len(dag.options) + 1, inf)]
    h.addVars(n, np.zeros(n), upper)
    h.changeColsCost(n, np.arange(n, dtype=np.int32), cost)
    h.changeColsIntegrality(col, np.arange(col, dtype=np.int32), np.array([highspy.HighsVarType.kInteger] * col))
    rows = []
    for v, options in enumerate(dag.options):
        rows.append((x_cols[v], np.ones(len(options)), 1.0, 1.0))
        durations = np.array([t for _, t, _ in options])
        rows.append((np.r_[t_col, s_cols[v], x_cols[v]], np.r_[1.0, -1.0, -durations], 0.0, inf))
        for u, delay in dag.preds[v]:
            before = np.array([t for _, t, _ in dag.options[u]])
            rows.append((np.r_[s_cols[v], s_cols[u], x_cols[u]], np.r_[1.0, -1.0, -before], delay, inf))
    starts = np.cumsum([0] + [len(idx) for idx, *_ in rows[:-1]]).astype(np.int32)
    index = np.concatenate([idx for idx, *_ in rows]).astype(np.int32)
    value = np.concatenate([val for _, val, *_ in rows]).astype(float)
    h.addRows(len(rows), np.array([r[2] for r in rows], dtype=float), np.array([r[3] for r in rows], dtype=float),
              index.size, starts, index, value)
    return h, {"x": x_cols, "s": s_cols, "T": t_col}
