"""Fault injection for ``plait launch``'s tests and drills: a worker kills or stops itself, or takes its whole node
down, at its first module forward of a chosen step (in the middle of the step), so that a failure lands at the same
place in every run.

- ``kill``: the worker SIGKILLs itself (a crashed process: its sockets close, its peers fail at once);
- ``stop``: the worker SIGSTOPs itself (a hung process: alive, sockets open, no heartbeat); its node's agent
  notices the silent heartbeat after ``--hang-timeout`` seconds and kills it (``plait.commands.launch``);
- ``kill node``: the node's agent and every worker of the node are SIGKILLed at once (a node lost with its agent),
  the agent's pid from ``os.getppid()`` and its workers' pids from the store key ``pids/node<r>`` the agent keeps.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

from torch.nn.modules.module import register_module_forward_pre_hook

__all__ = ["Faults", "node_pids_key"]


def node_pids_key(node: int) -> str:
    """The store key under which node ``node``'s agent keeps its live workers' pids (a JSON list)."""
    return f"pids/node{node}"


class Faults:
    """The faults of one worker (worker ids and steps as ``plait launch``'s ``--kill``, ``--stop`` and
    ``--kill-node`` give them; nodes numbered as ``--node-rank``).

    Args:
        worker: this worker's id.
        node: this worker's node.
        kills, stops: ``(worker, step)`` pairs.
        node_kills: ``(node, step)`` pairs: the lowest worker id of that node still alive in that step acts.
        read_pids: returns the store's value of a key (the node's worker pids).
    """

    def __init__(self, worker: int, node: int, kills: Sequence[tuple[int, int]] = (),
                 stops: Sequence[tuple[int, int]] = (), node_kills: Sequence[tuple[int, int]] = (),
                 read_pids: Callable[[str], str] | None = None) -> None:
        self.worker, self.node = worker, node
        self.kills, self.stops, self.node_kills = set(kills), set(stops), set(node_kills)
        self.read_pids = read_pids

    def arm(self, step: int, node_members: Sequence[int] = ()) -> Any:
        """The hook that injects this worker's fault of ``step`` at its first module forward (remove it after the
        step), or None. ``node_members``: the live workers of this worker's node (the lowest one takes the node
        down)."""
        if (self.worker, step) in self.kills:
            return register_module_forward_pre_hook(lambda module, args: os.kill(os.getpid(), signal.SIGKILL))
        if (self.worker, step) in self.stops:
            return register_module_forward_pre_hook(lambda module, args: os.kill(os.getpid(), signal.SIGSTOP))
        if (self.node, step) in self.node_kills and node_members and self.worker == min(node_members):
            return register_module_forward_pre_hook(lambda module, args: self._kill_node())
        return None

    def _kill_node(self) -> None:
        """SIGKILL this node's agent, then its other workers, then this process."""
        pids = json.loads(self.read_pids(node_pids_key(self.node))) if self.read_pids is not None else []
        for pid in [os.getppid(), *(p for p in pids if p != os.getpid())]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)
