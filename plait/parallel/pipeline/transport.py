"""Ordered P2P messages between the ranks of one pipeline (sends never waited for until the end of the step, as
``check_schedule``'s deadlock model requires).

Messages between two ranks are matched in the order the sender's schedule emits them (the receiver derives that
order from the schedule and buffers messages that arrive before they are needed), so no tags are needed (NCCL has
none). On gloo (CPU) a message is one packed uint8 buffer (:mod:`plait.parallel.pipeline.wire`) and the receiver
posts the receive of the next message of each channel ahead of time, into a buffer of a capacity both sides
grow alike (:class:`~plait.parallel.pipeline.comm.ChannelCapacities`: the next power of two of the largest
message so far; a larger message sends its rest in a second part): gloo's ``isend`` then finds the receive
posted and writes the bytes at once, whereas a receive posted after the send waits for gloo's background thread
on the sender, which gets no core for milliseconds while the sender computes. Other backends send the header
(``HEADER_SLOTS`` slots, a longer one continues in a second message) and then the tensors, each group by one
``dist.batch_isend_irecv``.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from plait.parallel.pipeline.comm import PipelineComm
from plait.parallel.pipeline.wire import HEADER_SLOTS, decode_header, encode_header, pack, payload_tensors, unpack
from plait.planner.pipeline.schedule_ir import Action, Schedule

__all__ = ["MessageKey", "Transport", "messages"]

MessageKey = tuple[str, int, int, int]  # (kind "F"/"B", sending stage, receiving stage, microbatch)
def messages(plan: Any, action: Action) -> list[MessageKey]:
    """Messages ``action`` sends to other ranks, in the order the runtime posts them."""
    s, m, rank = action.stage, action.microbatch, plan.stages[action.stage].rank
    if action.kind == "F":
        return [("F", s, t, m) for t in plan.successors(s) if plan.stages[t].rank != rank]
    if action.kind == "B":
        return [("B", s, p, m) for p in plan.predecessors(s)
                if plan.stages[p].runs_backward and plan.stages[p].rank != rank]
    return []


class Transport:
    """Ordered P2P messages of one step between the ranks of one pipeline (module docstring)."""

    def __init__(self, comm: PipelineComm, schedule: Schedule) -> None:
        self.comm, self.plan = comm, schedule.plan
        self.pending: list[tuple[Any, list[torch.Tensor]]] = []
        self.expected: dict[int, deque[MessageKey]] = defaultdict(deque)
        self.arrived: dict[MessageKey, dict[str, list[torch.Tensor | None]]] = {}
        self.posted: dict[int, tuple[torch.Tensor, Any]] = {}  # packed: pipeline rank -> pre-posted receive
        for src, actions in enumerate(schedule.actions):
            for action in actions:
                for key in messages(self.plan, action):
                    if self.plan.stages[key[2]].rank == comm.pp_rank and src != comm.pp_rank:
                        self.expected[src].append(key)
        self.me = comm.pp_ranks[comm.pp_rank]
        self.packed = comm.device.type == "cpu" and dist.get_backend() == "gloo"
        if self.packed:
            for src in self.expected:
                self._post(src)

    def modules_of(self, key: MessageKey) -> tuple[str, ...]:
        """Modules of a message's payload: the sender's for activations, the receiver's for gradients."""
        return self.plan.stages[key[1] if key[0] == "F" else key[2]].modules

    def send(self, key: MessageKey, payload: Mapping[str, Sequence[torch.Tensor | None]]) -> None:
        """Post the message (header and tensors) without waiting for it."""
        peer = self.comm.pp_ranks[self.plan.stages[key[2]].rank]
        header = encode_header(self.modules_of(key), payload)
        tensors = payload_tensors(self.modules_of(key), payload)
        self.pending = [(works, held) for works, held in self.pending if not all(w.is_completed() for w in works)]
        if self.packed:
            groups = self._packed_parts(header, tensors, peer)
        else:
            groups = [self._header_buffers(header), tensors]
        for group in groups:
            if group:
                ops = [dist.P2POp(dist.isend, t, peer) for t in group]
                self.pending.append((dist.batch_isend_irecv(ops), group))  # buffers live until the send is done

    def _packed_parts(self, header: list[int], tensors: list[torch.Tensor], peer: int) -> list[list[torch.Tensor]]:
        """The message as one buffer: its first part fits the receive the peer posted ahead, the rest (only
        when the message outgrew that) follows as a second send."""
        buf = pack(header, tensors, self.comm.capacities.get(self.me, peer))
        first = int(buf[8:16].view(torch.int64).item())
        self.comm.capacities.grow(self.me, peer, buf.numel())
        return [[buf[:first]], [buf[first:]] if buf.numel() > first else []]

    def receive(self, key: MessageKey) -> dict[str, list[torch.Tensor | None]]:
        """The payload of message ``key``, receiving (and buffering) earlier messages of its channel first.

        Raises:
            RuntimeError: when the schedule gives no such message from the sender's rank.
        """
        src = self.plan.stages[key[1]].rank
        while key not in self.arrived:
            if not self.expected[src]:
                raise RuntimeError(f"pipeline rank {self.comm.pp_rank}: message {key} is not expected from rank {src}")
            nxt = self.expected[src].popleft()
            receive = self._receive_packed if self.packed else self._receive_one
            self.arrived[nxt] = receive(nxt, src)
        return self.arrived.pop(key)

    def _post(self, src: int) -> None:
        """Post the receive of the next message from pipeline rank ``src`` ahead of time (packed messages): the
        sender's ``isend`` then finds it and writes the bytes at once (module docstring; bench/sim_vs_measured.py)."""
        peer = self.comm.pp_ranks[src]
        buf = torch.empty(self.comm.capacities.get(peer, self.me), dtype=torch.uint8)
        self.posted[src] = (buf, dist.irecv(buf, peer))

    def _receive_packed(self, key: MessageKey, src: int) -> dict[str, list[torch.Tensor | None]]:
        peer = self.comm.pp_ranks[src]
        buf, work = self.posted.pop(src)
        work.wait()
        total, first = buf[:16].view(torch.int64).tolist()
        if total > first:  # the message outgrew the pre-posted receive: its rest follows
            full = torch.empty(total, dtype=torch.uint8)
            full[:first].copy_(buf[:first])
            self._recv([full[first:]], peer)
            buf = full
        self.comm.capacities.grow(peer, self.me, total)
        if self.expected[src]:
            self._post(src)
        return unpack(buf[:total], self.modules_of(key))

    def _receive_one(self, key: MessageKey, src: int) -> dict[str, list[torch.Tensor | None]]:
        peer = self.comm.pp_ranks[src]
        first = torch.zeros(HEADER_SLOTS, dtype=torch.long, device=self.comm.device)
        self._recv([first], peer)
        header = first.tolist()
        if header[0] > HEADER_SLOTS:
            rest = torch.zeros(header[0] - HEADER_SLOTS, dtype=torch.long, device=self.comm.device)
            self._recv([rest], peer)
            header += rest.tolist()
        specs = decode_header(self.modules_of(key), header)
        out = {m: [None if s is None else torch.empty(s[1], dtype=s[0], device=self.comm.device) for s in lst]
               for m, lst in specs.items()}
        self._recv([t for lst in out.values() for t in lst if t is not None and t.numel()], peer)
        for module, lst in specs.items():
            for t, spec in zip(out[module], lst):
                if t is not None and spec is not None:
                    t.requires_grad_(spec[2])
        return out

    def _header_buffers(self, header: list[int]) -> list[torch.Tensor]:
        padded = header + [0] * max(0, HEADER_SLOTS - len(header))
        full = torch.tensor(padded, dtype=torch.long, device=self.comm.device)
        return [full[:HEADER_SLOTS]] + ([full[HEADER_SLOTS:]] if len(header) > HEADER_SLOTS else [])

    @staticmethod
    def _recv(tensors: list[torch.Tensor], peer: int) -> None:
        if tensors:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer) for t in tensors]):
                work.wait()

    def finish(self) -> None:
        """Wait for every posted send (end of the step).

        Raises:
            RuntimeError: when receives were posted for messages the step never took.
        """
        for works, _ in self.pending:
            for work in works:
                work.wait()
        self.pending.clear()
        if self.posted:
            raise RuntimeError(f"pipeline rank {self.comm.pp_rank}: receives posted for messages never taken from "
                               f"ranks {sorted(self.posted)}")
