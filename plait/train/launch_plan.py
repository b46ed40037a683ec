"""What ``plait launch`` decided before starting its workers (``launch.json``): the pipeline templates, the first
instantiation, the collective timeout, the nodes and the injected faults (:class:`LaunchPlan`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from plait.planner.resilience.templates import node_domains
from plait.planner.resilience.types import Instantiation, TemplateSet

__all__ = ["LaunchPlan"]


@dataclass(frozen=True)
class LaunchPlan:
    """What the launcher decided before starting the workers (written as ``launch.json``).

    Attributes:
        templates: the pipeline templates for the job's ranks and ``f``.
        instantiation: the first instantiation (its ranks are worker ids; shard groups when the templates' ``dp_shard``
            is above 1: ``plait.planner.resilience.shards``).
        timeout_s: collective timeout of the workers' groups (seconds): a hung peer is detected after it.
        kills: fault injection for tests: ``(worker, step)`` pairs; that worker SIGKILLs itself at the first module
            forward of that step (in the middle of the step; ``plait.train.faults``).
        rejoins: ``(worker, step)`` pairs: the launcher restarts that worker once it died, and the members admit it
            at the start of that step (waiting for it at most ``2 * timeout_s``).
        nodes: the job's nodes (agents); worker ``w`` runs on node ``w // (workers / nodes)``, and with more than
            one node, nodes are the failure domains of the instantiations.
        stops: fault injection: ``(worker, step)`` pairs; that worker SIGSTOPs itself mid-step (a hung worker).
        node_kills: fault injection: ``(node, step)`` pairs; that node's agent and workers are SIGKILLed at once
            mid-step (a lost node).
    """

    templates: TemplateSet
    instantiation: Instantiation
    timeout_s: float = 10.0
    kills: tuple[tuple[int, int], ...] = ()
    rejoins: tuple[tuple[int, int], ...] = ()
    nodes: int = 1
    stops: tuple[tuple[int, int], ...] = ()
    node_kills: tuple[tuple[int, int], ...] = ()

    @property
    def per_node(self) -> int:
        """Workers per node."""
        return self.templates.workers // self.nodes

    def node_workers(self, worker: int) -> range:
        """The worker ids of ``worker``'s node (numbered node by node), itself included."""
        first = worker // self.per_node * self.per_node
        return range(first, first + self.per_node)

    def domains(self) -> dict[int, int] | None:
        """The planner's rank (a worker id, or a shard group) -> node, the failure domains (``templates.node_domains``;
        None on one node)."""
        return node_domains(self.templates.num_ranks, self.nodes)

    def to_json(self) -> str:
        """The plan as JSON (templates and instantiation by their own ``to_dict``)."""
        pairs = {name: [list(k) for k in getattr(self, name)] for name in ("kills", "rejoins", "stops", "node_kills")}
        return json.dumps({"templates": self.templates.to_dict(), "instantiation": self.instantiation.to_dict(),
                           "timeout_s": self.timeout_s, "nodes": self.nodes, **pairs})

    @classmethod
    def from_json(cls, text: str) -> LaunchPlan:
        """Read :meth:`to_json`'s output."""
        d = json.loads(text)
        pairs = {name: tuple((int(a), int(b)) for a, b in d.get(name, ()))
                 for name in ("kills", "rejoins", "stops", "node_kills")}
        return cls(TemplateSet.from_dict(d["templates"]), Instantiation.from_dict(d["instantiation"]),
                   float(d["timeout_s"]), nodes=int(d.get("nodes", 1)), **pairs)
