"""Admitting workers into a running ``plait launch`` job (``plait.train.resilient``): restarted workers, a node
started again, at a step boundary (Oobleck, Jang et al., SOSP 2023: scaling back up after failures).

:class:`JoinerAdmission` is the part of :class:`~plait.train.resilient.ResilientWorker` that decides, the same way on
every member, which workers outside the job join at the start of a step, re-forms the group over them
(``Membership.admit``), re-instantiates over the larger set (``plan_rejoin``) and copies them their units
(``ResilientWorker.build_run``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from plait.planner.resilience.reconfigure import plan_rejoin
from plait.planner.resilience.types import Instantiation
from plait.train.run_start import say

__all__ = ["JoinerAdmission"]


class JoinerAdmission:
    """Joiner admission of a resilient worker. The class it is mixed into provides ``plan`` (the ``LaunchPlan``),
    ``membership``, ``asking_since`` (rank 0's record: worker -> the step it was first seen asking), ``build_run``
    and ``_log``."""

    plan: Any
    membership: Any
    asking_since: dict[int, int]

    def admit_joiners(self, run: Any, step: int) -> Any:
        """At the start of ``step``: admit the workers planned to rejoin then (``LaunchPlan.rejoins``) that asked
        (rank 0 waits for them at most ``2 * timeout_s`` and announces who came through the store,
        :meth:`Membership.announce`), re-instantiate over the larger set (``plan_rejoin``) and copy their units to
        them. Collective."""
        planned = [w for w, s in self.plan.rejoins if s == step and w not in self.membership.members]
        joiners = self._asked(step)
        if planned:
            decided = None
            if self.membership.rank == 0:
                deadline = time.monotonic() + 2 * self.plan.timeout_s
                while len(self.membership.joined(planned)) < len(planned) and time.monotonic() < deadline:
                    time.sleep(0.05)
                decided = json.dumps(self.membership.joined(planned))
            # through the store, not a broadcast: rank 0 may wait longer than the collective timeout for a slow start
            joiners += json.loads(self.membership.announce(f"joiners/step{step}", decided, 3 * self.plan.timeout_s))
        joiners = sorted(set(joiners))
        if not joiners:
            return run
        start = time.monotonic()
        run.drop_groups()
        self.membership.admit(joiners, {"step": step, "inst": run.inst.to_dict(), "joiners": joiners})
        return self._apply_rejoin(run.inst, joiners, run, start)

    def _asked(self, step: int) -> list[int]:
        """Workers not planned to rejoin at a later step (``LaunchPlan.rejoins``) that asked to join (a node started
        again, or a planned joiner too late for its step) and are admitted at the start of ``step``: rank 0 wrote them
        under ``asked/step<step>`` at the start of the step before (:meth:`Membership.post`), before its vote to
        commit that step, which every member's commit waited for, so every member reads the same list. Rank 0 then
        writes the next step's: a node's workers together once all of its absent ones ask (one re-instantiation,
        not one per worker), or any that has asked for 2 steps."""
        membership = self.membership
        asked = json.loads(membership.posted(f"asked/step{step}") or "[]")
        if membership.rank == 0:  # a planned rejoin waits for its step; one that missed it is admitted as it asks
            planned = {w for w, s in self.plan.rejoins if s > step}
            outside = [w for w in range(membership.world) if w not in planned and w not in asked]
            asking = set(membership.joined(outside))
            self.asking_since = {w: self.asking_since.get(w, step) for w in asking}
            ready = [w for w in sorted(asking) if step - self.asking_since[w] >= 2 or all(
                v in asking or v in membership.members or v in asked for v in self.plan.node_workers(w))]
            membership.post(f"asked/step{step + 1}", json.dumps(ready))
        return [w for w in asked if w not in membership.members]

    def _apply_rejoin(self, inst: Instantiation, joiners: Sequence[int], run: Any,
                      start: float) -> Any:
        rec = plan_rejoin(self.plan.templates, inst, joiners, self.plan.domains())
        new = self.build_run(rec.after, run, rec.transfers)
        seconds = time.monotonic() - start
        if self.membership.rank == 0:
            say(f"plait launch: worker(s) {list(joiners)} rejoined in {seconds:.2f} s; {len(rec.transfers)} unit "
                f"copies, {rec.bytes / 2**20:.1f} MiB; workers per pipeline "
                f"{[list(p.ranks) for p in rec.after.pipelines]}")
        self._log({"event": "rejoin", "joined": list(joiners), "bytes": rec.bytes, "seconds": seconds,
                   "pipelines": [list(p.ranks) for p in rec.after.pipelines]})
        return new
