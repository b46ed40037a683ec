"""Membership of a job whose workers may die: heartbeats in a ``TCPStore``, agreement on the surviving set, and
the default gloo process group re-formed in the same processes (destroy and
re-initialise on a new store prefix, what Oobleck does).

The store is hosted outside the workers (the launcher, or a test's parent process), so the failure of any worker,
rank 0 included, leaves it up. Each worker:

1. :meth:`Membership.join` starts a heartbeat thread (its own store connection writes ``hb/<id>`` = the time every
   ``heartbeat_s``) and forms generation 0: the default process group of every worker, on the store prefix
   ``gen0/``.
2. When a collective or P2P call fails (gloo raises once a peer's socket closes, or after the group's timeout),
   the survivor calls :meth:`Membership.reform`: it marks itself present in the next generation (appends its id
   to ``gen<g+1>/present``). The first survivor to arrive settles the members: it waits until every member of
   generation ``g`` is either present there or has a stale heartbeat (none for ``dead_after_s``), a ``dead/<id>``
   key (the launcher writes it when a child exits) or a ``join/<id>`` key (a new process of it asks to join), and
   writes the present ones under ``gen<g+1>/members``; the others wait on that key. A live member keeps beating,
   so the settler waits for it until it is present; a dead one never becomes present (a member dying during the
   agreement fails the next group and leads to one more generation).
3. It aborts its process groups first (:meth:`Membership.abandon`: their sockets close, so peers still blocked
   on it fail at once), then initialises the default group again over the survivors, ranked by their
   worker ids, on the prefix ``gen<g+1>/``.

Between a step's gradients and its optimizer step, every member votes through the store
(:meth:`Membership.commit`, a two-phase commit decided once by the store's atomic ``compare_set``): either every
survivor applies the step or none does, which an all-reduce vote cannot promise (a peer may die while some ranks
have its result and others not).

Worker ids are the ranks of generation 0 and never change; :attr:`Membership.rank` is the rank in the current
group. Survivors' tensors, modules and optimizers stay in memory: the caller applies its reconfiguration plan
(``plait.planner.resilience.reconfigure``) and replays the interrupted step.
"""

from __future__ import annotations

import datetime
import gc
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["Membership", "NoQuorumError", "closed", "forget_process", "last_beat"]


def last_beat(store: dist.Store, worker: int) -> float | None:
    """The wall-clock time (``time.time()``, seconds) of ``worker``'s last heartbeat in ``store``; None before its
    first (or after its launcher removed it, :func:`forget_process`)."""
    return float(store.get(f"hb/{worker}").decode()) if store.check([f"hb/{worker}"]) else None


def closed(store: dist.Store, worker: int) -> bool:
    """Whether ``worker`` closed its membership (:meth:`Membership.close`: a clean exit, its heartbeat stopped)."""
    return store.check([f"closed/{worker}"])


def forget_process(store: dist.Store, worker: int) -> None:
    """Remove ``worker``'s heartbeat marks before a new process of it starts: the previous process's silence is not
    the new one's (its launcher calls this; :meth:`Membership._gone` then counts the old process gone)."""
    store.delete_key(f"hb/{worker}")
    store.delete_key(f"closed/{worker}")


class NoQuorumError(RuntimeError):
    """Fewer survivors than the job needs (or this worker was declared dead by the others)."""


@dataclass
class Membership:
    """This worker's view of the job's members (see the module docstring).

    Attributes:
        host, port: the ``TCPStore`` server (hosted outside the workers).
        worker: this worker's id (its rank in generation 0).
        world: workers in generation 0.
        heartbeat_s: seconds between heartbeats.
        dead_after_s: a member whose heartbeat is older than this is dead (seconds; a few heartbeats).
        timeout_s: collective timeout of the process groups (a hung peer is detected after it); the agreement
            waits at most twice as long (seconds).
        connect_timeout_s: how long opening a store connection may take (seconds). Apart from ``timeout_s``: on a
            loaded host, or at a large job's start, a connection takes longer than a short collective timeout.
        min_members: fewer survivors raise :class:`NoQuorumError`.
        start_timeout_s: how long :meth:`join` waits for every worker of generation 0 to connect (seconds): the
            nodes of a job start at different times, so the first group forms only once all are there.
        generation: the current generation (0 at :meth:`join`).
        members: worker ids of the current generation, ascending (``members[rank]`` is that rank's worker).
    """

    host: str
    port: int
    worker: int
    world: int
    heartbeat_s: float = 0.2
    dead_after_s: float = 1.5
    timeout_s: float = 20.0
    connect_timeout_s: float = 60.0
    min_members: int = 1
    start_timeout_s: float = 600.0
    generation: int = 0
    members: tuple[int, ...] = ()
    _store: dist.TCPStore | None = field(default=None, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.worker < self.world:
            raise ValueError(f"worker id {self.worker} outside 0..{self.world - 1}")
        if not 0 < self.heartbeat_s < self.dead_after_s:
            raise ValueError(f"need 0 < heartbeat_s < dead_after_s, got {self.heartbeat_s} and {self.dead_after_s}")

    @property
    def rank(self) -> int:
        """This worker's rank in the current process group."""
        return self.members.index(self.worker)

    def _connect(self) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, is_master=False,
                             timeout=datetime.timedelta(seconds=self.connect_timeout_s))

    def connect(self) -> None:
        """Connect to the store and start this worker's heartbeat (no process group: :meth:`join` and
        :meth:`rejoin` form one afterwards)."""
        self._store = self._connect()
        self._beat(self._store)
        self._thread = threading.Thread(target=self._heartbeats, daemon=True, name=f"heartbeat-{self.worker}")
        self._thread.start()

    def join(self) -> None:
        """Start the heartbeat and form generation 0 (the default gloo group of all ``world`` workers), then mark
        the job formed (store key ``formed``: a worker started later must :meth:`rejoin`). Collective over every
        worker."""
        self.connect()
        self.members = tuple(range(self.world))
        self._await_start()
        self._init_group()
        self._store.set("formed", "1")

    def _await_start(self) -> None:
        """Wait until every worker of generation 0 has connected: the last to arrive (an atomic count) sets
        ``start/all``, the others wait on it server-side, so the group's collective timeout only runs once every node
        is up.

        Raises:
            NoQuorumError: naming how many arrived, when not all do within ``start_timeout_s``.
        """
        if self._store.add("start/arrived", 1) == self.world:
            self._store.set("start/all", "1")
        try:
            self._store.wait(["start/all"], datetime.timedelta(seconds=self.start_timeout_s))
        except RuntimeError:  # DistStoreError: the wait timed out
            arrived = self._store.add("start/arrived", 0)
            raise NoQuorumError(f"worker {self.worker}: {arrived} of {self.world} workers started within "
                                f"{self.start_timeout_s:g} s; start every node's plait launch (all with the same "
                                "--nproc and --nnodes)") from None

    def _beat(self, store: dist.TCPStore) -> None:
        store.set(f"hb/{self.worker}", repr(time.time()))

    def _heartbeats(self) -> None:
        store = self._connect()  # its own connection: store clients are not shared across threads
        while not self._stop.wait(self.heartbeat_s):
            self._beat(store)

    def _init_group(self) -> None:
        prefix = dist.PrefixStore(f"gen{self.generation}/", self._store)
        dist.init_process_group("gloo", store=prefix, rank=self.rank, world_size=len(self.members),
                                timeout=datetime.timedelta(seconds=self.timeout_s))

    def reform(self) -> tuple[int, ...]:
        """After a failed collective: agree with the other survivors on the next generation's members and
        re-form the default process group over them. Returns the workers that left.

        The first survivor to arrive (an atomic ``store.add``) settles the members (:meth:`_settle`) and writes
        them under ``gen<g+1>/members``; the others wait on that key (a server-side wait, no polling), so a failure
        costs the store a few requests per survivor and the polling of one. When the settler dies, the others settle
        themselves after ``2 * timeout_s``: its present mark then fails the next group and leads to one more
        generation.

        Raises:
            NoQuorumError: when fewer than ``min_members`` survive, when this worker is not among them, or when
                the agreement does not settle within ``2 * timeout_s``.
        """
        self.abandon()
        nxt = self.generation + 1
        settler = self._store.add(f"gen{nxt}/arrivals", 1) == 1
        self._store.append(f"gen{nxt}/present", f"{self.worker},")  # one key: one read per poll, not one per member
        decided = f"gen{nxt}/members"
        if not settler:
            try:
                self._store.wait([decided], datetime.timedelta(seconds=2 * self.timeout_s))
            except RuntimeError:  # DistStoreError: the settler died while settling
                settler = True
        if settler and not self._store.check([decided]):
            self._store.compare_set(decided, "", json.dumps(self._settle(nxt)))  # the first decision stands
        return self._switch(nxt, tuple(json.loads(self._store.get(decided).decode())))

    def _settle(self, nxt: int) -> list[int]:
        """The members of generation ``nxt``: wait until every member of this one is present there (its id in
        ``gen<nxt>/present``) or gone (:meth:`_gone`), polling every ``heartbeat_s / 2``; returns the present ones.

        Raises:
            NoQuorumError: when that does not happen within ``2 * timeout_s``.
        """
        deadline = time.monotonic() + 2 * self.timeout_s
        while True:
            listed = {int(w) for w in self._store.get(f"gen{nxt}/present").decode().split(",") if w}
            present = [w for w in self.members if w in listed]
            stale = [w for w in self.members if w not in listed and self._gone(w)]
            if len(present) + len(stale) == len(self.members):
                return present
            if time.monotonic() > deadline:
                raise NoQuorumError(f"worker {self.worker}: generation {nxt} did not settle in "
                                    f"{2 * self.timeout_s} s (present {present}, dead {stale}, "
                                    f"of {list(self.members)})")
            time.sleep(self.heartbeat_s / 2)

    def _gone(self, worker: int) -> bool:
        """Whether ``worker``'s process of this generation is dead: the launcher's ``dead/<id>`` key; a ``join/<id>``
        key (a new process of that worker asks to join, :meth:`rejoin`); no heartbeat key (its launcher deleted it to
        start a new process); or no heartbeat for ``dead_after_s``."""
        if any(self._store.check([f"{key}/{worker}"]) for key in ("dead", "join")):
            return True
        beat = last_beat(self._store, worker)
        return beat is None or time.time() - beat > self.dead_after_s

    def commit(self, tag: str, ready: bool = True) -> bool:
        """Two-phase commit through the store of what ``tag`` names (``"step<k>"``: step ``k``'s optimizer step;
        ``"save<k>"``: its checkpoint): whether every member may go on as if it succeeded everywhere.

        Phase 1: a member that saw it through writes ``commit/gen<g>/<tag>/ready/<id>`` and waits until every
        member of the generation is ready (proposal: commit), or some member that is not ready is dead
        (:meth:`_gone`), or the wait passes ``2 * timeout_s`` (proposal: abort). A member that saw a failure
        during the step (``ready=False``) proposes abort at once, so the others stop waiting for it. Phase 2: the
        first proposal written to ``commit/gen<g>/<tag>/decision`` (the store's atomic ``compare_set``) is the
        decision every member reads back and follows. So either every survivor applies the step or none does,
        even when a member dies right after writing its ready key, or a member thought dead (a stale heartbeat)
        is ready after all: a decision is written once, and a commit needs every member's ready key.

        Returns:
            True to apply it; False to abandon it (re-form the group, :meth:`reform`, and replay it).
        """
        base = f"commit/gen{self.generation}/{tag}/"
        proposal = "abort"
        if ready:
            self._store.set(f"{base}ready/{self.worker}", "1")
            proposal = self._await_ready(base, self._store.add(f"{base}count", 1))
        return self._store.compare_set(f"{base}decision", "", proposal).decode() == "commit"

    def _await_ready(self, base: str, count: int) -> str:
        """Phase 1 of :meth:`commit` (``count``: the members ready so far, this one included): ``"commit"`` once
        every member is ready, ``"abort"`` when a member that is not is dead, the wait passes ``2 * timeout_s``, or
        another member already decided abort. Each poll reads one counter (``store.add(key, 0)``); the members not
        ready are looked up one by one only every ``heartbeat_s``, so a step's commit costs each member a few
        requests, not one per member (the store serves every member of a large job)."""
        deadline, pause = time.monotonic() + 2 * self.timeout_s, 0.001
        looked = time.monotonic()
        while count < len(self.members):
            if self._store.check([f"{base}decision"]):
                return self._store.get(f"{base}decision").decode()
            if time.monotonic() - looked >= self.heartbeat_s:
                looked = time.monotonic()
                missing = [w for w in self.members if not self._store.check([f"{base}ready/{w}"])]
                if any(self._gone(w) for w in missing):
                    return "abort"
            if time.monotonic() > deadline:
                return "abort"
            time.sleep(pause)
            pause = min(2 * pause, self.heartbeat_s / 4)
            count = self._store.add(f"{base}count", 0)
        return "commit"

    def abandon(self) -> None:
        """Abort every process group of this worker now: their sockets close, so a peer blocked on this worker
        in a collective or P2P call fails at once instead of after its timeout (the failure cascades to every
        survivor in about a second). :meth:`reform` calls it first; the groups are unusable afterwards. A group's
        sockets close when its last reference goes: callers drop theirs (e.g. gradient groups) before."""
        for group in list(c10d._world.pg_map):
            try:
                group._get_backend(torch.device("cpu")).abort()
            except RuntimeError:  # no CPU backend, or already aborted
                pass
        if dist.is_initialized():
            c10d._abort_process_group()
        gc.collect()  # the aborted groups' last references: their sockets close now

    def _switch(self, generation: int, survivors: Sequence[int]) -> tuple[int, ...]:
        if len(survivors) < self.min_members or self.worker not in survivors:
            raise NoQuorumError(f"worker {self.worker}: {len(survivors)} survivors {list(survivors)}, "
                                f"{self.min_members} needed")
        left = tuple(w for w in self.members if w not in survivors)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.generation, self.members = generation, tuple(sorted(survivors))
        self._init_group()
        return left

    def rejoin(self) -> dict:
        """A restarted worker asks to join (``join/<id>``) and waits until the members admit it
        (:meth:`admit`), then joins their new generation. Returns the members' payload (what the job needs to
        continue: its step, instantiation, ...).

        Raises:
            NoQuorumError: when no admission comes within ``10 * timeout_s`` seconds.
        """
        self.connect()
        self._store.delete_key(f"dead/{self.worker}")  # the launcher's mark of this worker's previous process
        self._store.delete_key(f"admit/{self.worker}")  # the admission of its previous process, if any
        self._store.set(f"join/{self.worker}", "1")
        deadline = time.monotonic() + 10 * self.timeout_s
        while not self._store.check([f"admit/{self.worker}"]):
            if time.monotonic() > deadline:
                raise NoQuorumError(f"worker {self.worker}: not admitted within {10 * self.timeout_s} s")
            time.sleep(self.heartbeat_s / 2)
        payload = json.loads(self._store.get(f"admit/{self.worker}").decode())
        self.generation, self.members = int(payload["generation"]), tuple(payload["members"])
        self._init_group()
        return payload

    def joined(self, candidates: Sequence[int]) -> list[int]:
        """Which of ``candidates`` (not members) asked to join (:meth:`rejoin`); read from the store, so the
        members must agree on the answer themselves (rank 0 reads, :meth:`announce` tells the others)."""
        return [w for w in candidates if w not in self.members and self._store.check([f"join/{w}"])]

    def post(self, key: str, value: str) -> None:
        """Write ``value`` under ``key`` in the store (for the others to read with :meth:`posted`); returns once the
        store holds it (a ``TCPStore`` set is not acknowledged, so a check on the same connection follows it)."""
        self._store.set(key, value)
        self._store.check([key])

    def posted(self, key: str) -> str | None:
        """The store's value under ``key``, or None when nothing was written there (no wait)."""
        return self._store.get(key).decode() if self._store.check([key]) else None

    def announce(self, key: str, value: str | None, wait_s: float) -> str:
        """What rank 0 decided under ``key`` in this generation, the same string on every member: rank 0 passes its
        ``value`` (written to the store), the others ``None`` and wait for it at most ``wait_s`` seconds. A store
        wait, not a collective: rank 0 may take longer than the groups' ``timeout_s`` to decide (waiting for a
        restarted worker to start) without the others' collective timing out.

        Raises:
            RuntimeError: (the store's ``DistStoreError``) when nothing is announced within ``wait_s``.
        """
        full = f"announce/gen{self.generation}/{key}"
        if value is not None:
            self._store.set(full, value)
            return value
        self._store.wait([full], datetime.timedelta(seconds=wait_s))
        return self._store.get(full).decode()

    def admit(self, joiners: Sequence[int], payload: dict) -> None:
        """Every member, at the same step boundary: admit ``joiners`` (rank 0 writes their ``admit/<id>`` with
        ``payload`` plus the new generation and members), abandon the current groups and form the next
        generation over members and joiners. Collective over the members and the joiners."""
        nxt, members = self.generation + 1, tuple(sorted(set(self.members) | set(joiners)))
        if self.rank == 0:
            for w in joiners:
                self._store.set(f"admit/{w}", json.dumps({**payload, "generation": nxt, "members": list(members)}))
                self._store.delete_key(f"join/{w}")  # answered: a later death and restart asks again
        self.abandon()
        self.generation, self.members = nxt, members
        self._init_group()

    def close(self) -> None:
        """Stop the heartbeat (marked ``closed/<id>``: its agent no longer takes the silence for a hang) and destroy
        the process group (a clean exit)."""
        if self._store is not None:
            self._store.set(f"closed/{self.worker}", "1")
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.heartbeat_s)
        if dist.is_initialized():
            dist.destroy_process_group()
