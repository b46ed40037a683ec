"""``plait plan --gpus-per-node``: plans that keep to whole nodes.

torchrun starts the same number of processes on every node, so a plan over more than one node must use a multiple of
the node's GPUs. :func:`whole_node_plan` keeps the search's plan when it does (or fits in one node) and otherwise
takes the fastest of the best plan on one node (any count up to its GPUs) and, for each node count ``k >= 2``
dividing the nodes available, the best plan using all ``k`` nodes' GPUs (``auto_layout.plan_filling_layout``).
"""

from __future__ import annotations

from collections.abc import Callable

from plait.planner.search.auto_layout import plan_filling_layout
from plait.planner.search.layout import plan_layout
from plait.planner.search.monotone import divisors
from plait.planner.search.parallel import LayoutSearch
from plait.planner.search.types import LayoutChoice

__all__ = ["on_whole_nodes", "partial_node_note", "whole_node_plan"]


def on_whole_nodes(processes: int, gpus_per_node: int) -> bool:
    """Whether ``processes`` fit one node of ``gpus_per_node`` GPUs or fill whole nodes (``gpus_per_node`` 0: one
    node, always true)."""
    return gpus_per_node <= 0 or processes <= gpus_per_node or processes % gpus_per_node == 0


def partial_node_note(devices: int, gpus_per_node: int) -> str:
    """The line saying the plan keeps to whole nodes when ``devices`` spans more than one node of ``gpus_per_node``
    GPUs but is not a multiple of it (the devices past the last whole node stay unused); ``""`` otherwise."""
    if gpus_per_node <= 0 or devices <= gpus_per_node or devices % gpus_per_node == 0:
        return ""
    nodes = devices // gpus_per_node
    return (f"--devices {devices} is not a multiple of --gpus-per-node {gpus_per_node}: the plan keeps to whole "
            f"nodes (torchrun starts the same count on every node), at most {nodes * gpus_per_node} devices on "
            f"{nodes} nodes")


def whole_node_plan(choice: LayoutChoice, devices: int, gpus_per_node: int,
                    search: Callable[[int, LayoutSearch], LayoutChoice]) -> LayoutChoice:
    """``choice`` (the search's plan on ``devices``) when its processes are on whole nodes (:func:`on_whole_nodes`),
    else the fastest (ties: fewer processes) of ``search(gpus_per_node, plan_layout)`` and
    ``search(k * gpus_per_node, plan_filling_layout)`` for each ``k >= 2`` dividing ``devices // gpus_per_node``.

    Args:
        search: the search on a device count with a layout search (``parallel.LayoutSearch``).

    Raises:
        ValueError: when none of those searches finds a plan (each one's reason).
    """
    if on_whole_nodes(choice.devices_used, gpus_per_node):
        return choice
    runs = [(gpus_per_node, plan_layout)] + [(k * gpus_per_node, plan_filling_layout)
                                             for k in divisors(devices // gpus_per_node) if k >= 2]
    found, errors = [], []
    for count, layout_search in runs:
        try:
            plan = search(count, layout_search)
        except ValueError as exc:
            errors.append(f"{count} devices: {exc}")
            continue
        if on_whole_nodes(plan.devices_used, gpus_per_node):
            found.append(plan)
    if not found:
        raise ValueError(f"no plan on whole nodes of {gpus_per_node} GPUs: " + ("; ".join(errors) or "none fills them"))
    return min(found, key=lambda c: (c.iteration_s, c.devices_used))
