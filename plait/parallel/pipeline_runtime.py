"""Execute a pipeline ``Schedule`` on this rank: forward/backward actions, P2P transfers, DP/CP reduction.

The runtime only executes (../shared/DESIGN.md, principle 3): the plan says which stage runs where, the
schedule says in which order each rank runs ``F``/``B``/``W`` of each microbatch. Transfers follow the
plan's edges: ``F(s, m)`` receives the payload of every predecessor and sends its output to its successor;
``B(s, m)`` receives the output gradient from the successor and sends the input gradient of each branch back
to the predecessors that run backward. Stages on the same rank hand payloads over locally.

Wire format of one message (sends are never waited for until the end of the step, as ``check_schedule``'s
deadlock model requires): an int64 header (slot 0 is the header's length) giving, per module of the sending
payload, the tensor count and each tensor's ndim, dtype and shape (ndim -1 for "no gradient"), then the tensors
themselves. An absent modality is a module with zero tensors, so a branch without input in a microbatch still
exchanges (empty) messages and nothing hangs. Messages between two ranks are matched in the order the sender's
schedule emits them (the receiver derives that order from the schedule and buffers messages that arrive before
they are needed), so no tags are needed (NCCL has none). On gloo (CPU) a message is one uint8 buffer (byte
totals, header, tensors 8-byte aligned; the tensors arrive as views of it) and the receiver posts the receive of
the next message of each channel ahead of time, into a buffer of a capacity both sides grow alike (the next power
of two of the largest message so far; a larger message sends its rest in a second part): gloo's ``isend`` then
finds the receive posted and writes the bytes at once, whereas a receive posted after the send waits for gloo's
background thread on the sender, which gets no core for milliseconds while the sender computes. Other backends
send the header (``HEADER_SLOTS`` slots, a longer one continues in a second message) and then the tensors, each
group by one ``dist.batch_isend_irecv``.

Frozen-aware execution (principle 6): a stage that runs no backward runs its forward under ``no_grad`` and
keeps nothing; a frozen stage that needs an input gradient keeps its activations and its backward computes
input gradients only (its parameters have ``requires_grad`` False). Loss: the last stage's sum of token
cross-entropies, each microbatch's backward scaled by ``1 / global target tokens`` (the whole global batch,
all DP replicas), and gradients summed over the DP group, so the result equals one process on the global
batch. With ``split_backward`` schedules ``B`` computes input gradients (``autograd.grad``, graph retained)
and ``W`` weight gradients (a second pass over the retained graph: correct, but it repeats the part of the
backward shared by both, so it is slower than a fused backward).

Context parallelism (CP, DESIGN "One training step"): each stage is replicated over a CP group (the innermost
rank axis, :class:`PipelineComm`); a pipeline is the stages with one CP index, and its messages carry only
that CP rank's LLM tokens. Encoder stages run on every CP rank (redundantly, as the non-pipeline trainer
does); the input-gradient of the features that reaches an encoder stage covers only its CP rank's tokens, so
every stage's parameter gradients are partial per CP rank and are summed over the DP x CP copies (like DP).
Each CP rank's last stage holds the loss of its tokens; the world sum of the losses is the global one. The
CP ranks of a stage run the same actions in the same order, so the K/V all-gathers (forward) and
reduce-scatters (backward, in ``B`` and again in ``W``) inside the LLM stages match up.

Deferred encoder outputs (issue 5; Entrain's level 2, ../shared/REFERENCES.md section 3; :class:`FeatureRouting`):
a microbatch plan may run a sample's LLM work in a later microbatch ``j`` than its encoder work ``i``. The schedule
and its messages stay as they are (``F``/``B`` of microbatch ``m`` on every stage): encoder stages run microbatch
``m`` of the encoder view, LLM stages microbatch ``m`` of the LLM view. The first LLM stage keeps the features
each branch sent for encoder microbatch ``i`` until the ``F`` of the last LLM microbatch reading them (these
bytes are counted: ``buffered_peak_bytes``), and builds each LLM microbatch's features, sample by sample in
placeholder order, as a fresh leaf. Its ``B(j)`` sends the gradient of exactly those features; an encoder
stage's ``B(j)``/``W(j)`` cut it per sample and back-propagate each piece through the graph of the encoder
microbatch that produced it (retaining a graph while a later LLM microbatch still has gradients for it), and
send upstream, per such encoder microbatch, the partial input gradients. By linearity the pieces sum to one
fused backward, so ``B(j)`` on an encoder stage still depends only on ``B(j)`` of its successor; only the
lifetime of an encoder microbatch's activations grows (to the last ``B`` of its readers).
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.data.collate import Batch
from plait.data.processing import IGNORE
from plait.parallel.data_parallel import sum_gradients
from plait.parallel.dims import ParallelDims, new_groups
from plait.parallel.stages import Payload, PipelineStage, RankStages
from plait.planner.types import LLM_MODULE
from plait.planner.schedules import Action, Schedule, TimelineEvent, frees_activations

__all__ = [
    "HEADER_SLOTS",
    "FeatureRouting",
    "PipelineComm",
    "PipelineStepResult",
    "build_pipeline_comm",
    "pipeline_comm_from_mesh",
    "run_pipeline_step",
    "clip_grad_norm_pipeline",
    "gather_timeline",
    "token_loss_sum",
]

HEADER_SLOTS = 64
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8)
_MessageKey = tuple[str, int, int, int]  # (kind "F"/"B", sending stage, receiving stage, microbatch)


@dataclass(frozen=True)
class PipelineComm:
    """This process's place in a DP x PP x CP job.

    Rank layout: :class:`~plait.parallel.dims.ParallelDims` (the CP axis innermost, then the pipeline axis). A pipeline is the ``pp`` ranks with one ``(dp_rank, cp_rank)``: its
    P2P messages carry the hidden states of that CP rank's tokens only.

    Attributes:
        pp_rank: coordinate on the pipeline axis (the plan's rank numbering).
        pp_ranks: global rank of every pipeline rank of this process's pipeline (same ``dp_rank``/``cp_rank``).
        dp_rank: index of this pipeline's model replica among the DP replicas.
        dp_size: number of DP replicas.
        dp_group: process group of the ranks with this ``pp_rank`` and ``cp_rank`` in every DP replica (None when
            ``dp_size == 1``).
        device: device of this rank's stages (P2P buffers live there: CPU for gloo, CUDA for NCCL).
        cp_rank: index of this rank in its stage's CP group.
        cp_size: CP degree (ranks sharing the tokens of every microbatch of one stage).
        cp_group: process group of this stage's CP ranks (None when ``cp_size == 1``); plait attention gathers
            K/V over it.
        grad_group: process group of every rank holding this ``pp_rank``'s stages (DP x CP ranks), over which
            gradients are summed (None when ``dp_size * cp_size == 1``; the DP group when ``cp_size == 1``).
    """

    pp_rank: int = 0
    pp_ranks: tuple[int, ...] = (0,)
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: Any = None
    grad_group: Any = None

    @property
    def distributed(self) -> bool:
        """True when this pipeline spans several processes (a default process group exists and there is more
        than one pipeline rank or stage copy). A one-process comm (the default) stays local even inside a
        distributed job, e.g. the profiler timing the runtime on rank 0 alone."""
        spans = len(self.pp_ranks) * self.stage_replicas > 1
        return spans and dist.is_available() and dist.is_initialized()

    @property
    def stage_replicas(self) -> int:
        """Ranks holding a copy of this rank's stages (``dp_size * cp_size``): the gradient sum runs over them."""
        return self.dp_size * self.cp_size

    @property
    def reduce_group(self) -> Any:
        """The group of the gradient sum (``grad_group``, falling back to ``dp_group`` for comms built without
        CP)."""
        return self.grad_group if self.grad_group is not None else self.dp_group


def build_pipeline_comm(pp_size: int, device: torch.device | str = "cpu", cp_size: int = 1,
                        dp_size: int = 0) -> PipelineComm:
    """Coordinates of this process in a DP x PP x CP job laid out by :class:`~plait.parallel.dims.ParallelDims`
    (see :class:`PipelineComm`); creates the DP, CP and gradient (DP x CP) groups. Collective: every rank must
    call it, with the same degrees (``dp_size`` = 0: from the world size).

    Raises:
        ValueError: when the degrees do not fit the world size (:meth:`ParallelDims.from_world`).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    dims = ParallelDims.from_world(world, pp_size, cp_size, dp_size)
    at = dims.coords(rank)
    dp_group = dims.new_group(("dp",), rank, dims.dp > 1)
    cp_group = dims.new_group(("cp",), rank, dims.cp > 1)
    grad_group = dp_group
    if dims.cp > 1:
        grad_group = dims.new_group(("dp", "cp"), rank, dims.dp > 1)
        grad_group = cp_group if grad_group is None else grad_group  # dp = 1: the CP group holds every copy
    if dist.is_initialized():
        dist.barrier()  # NCCL: the default communicator exists before the first batched P2P call
    return PipelineComm(at.pp, dims.pipeline_ranks(rank), at.dp, dims.dp, dp_group, torch.device(device), at.cp,
                        dims.cp, cp_group, grad_group)


def pipeline_comm_from_mesh(mesh: Any, device: torch.device | str = "cpu") -> PipelineComm:
    """:class:`PipelineComm` from a ``DeviceMesh`` with a ``"pp"`` axis and optionally ``"dp"`` and ``"cp"`` axes.
    With a ``"cp"`` axis of size > 1 the gradient groups (the ``"dp"`` x ``"cp"`` ranks of each pipeline
    coordinate) are created here: collective, every rank must call it.

    Raises:
        ValueError: when the mesh has no ``"pp"`` axis.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names:
        raise ValueError(f"the device mesh has axes {names}; a pipeline needs a 'pp' axis")
    pp_mesh = mesh["pp"]
    ranks = tuple(int(r) for r in pp_mesh.mesh.flatten().tolist())
    dp_size, dp_rank, group = 1, 0, None
    if "dp" in names and mesh["dp"].size() > 1:
        dp_size, dp_rank, group = mesh["dp"].size(), mesh.get_local_rank("dp"), mesh["dp"].get_group()
    cp_size, cp_rank, cp_group, grad_group = 1, 0, None, group
    if "cp" in names and mesh["cp"].size() > 1:
        cp_size, cp_rank, cp_group = mesh["cp"].size(), mesh.get_local_rank("cp"), mesh["cp"].get_group()
        grad_group = cp_group
        if dp_size > 1:
            grid = mesh.mesh.movedim(names.index("pp"), 0).reshape(mesh["pp"].size(), -1).tolist()
            grad_group = new_groups(grid, dist.get_rank(), True)
    return PipelineComm(mesh.get_local_rank("pp"), ranks, dp_rank, dp_size, group, torch.device(device), cp_rank,
                        cp_size, cp_group, grad_group)


@dataclass(frozen=True)
class PipelineStepResult:
    """One pipeline step (forward/backward of all microbatches, gradients reduced).

    Attributes:
        loss: global loss (sum of token cross-entropies / global target tokens), the same on every rank.
        loss_sum: the global sum of token cross-entropies.
        events: this rank's timed actions (``rank`` = pipeline rank; seconds since the epoch), compute only:
            waiting for a message is not inside an event.
        saved_tensors: per stage of this rank, tensors saved for backward by its forwards (with
            ``instrument=True``, else empty).
        backward_actions: per stage of this rank, ``B``/``W`` actions that ran a backward pass.
        buffered_peak_bytes: with a :class:`FeatureRouting`, the most bytes of encoder features this rank's first
            LLM stage held across a microbatch boundary for later LLM microbatches (deferred samples' encoder
            microbatches); 0 on other ranks and without routing.
    """

    loss: float
    loss_sum: float
    events: tuple[TimelineEvent, ...]
    saved_tensors: Mapping[int, int]
    backward_actions: Mapping[int, int]
    buffered_peak_bytes: int = 0


@dataclass(frozen=True)
class FeatureRouting:
    """Deferred encoder outputs (issue 5; Entrain's level 2, ../shared/REFERENCES.md section 3): the encoder view
    and the LLM view of one pipeline's ``M`` microbatches.

    Encoder stages run microbatch ``i`` on ``encoder_batches[i]`` (its ``modality_inputs``: the items of
    ``encoder_samples[i]``, in that order); LLM stages run microbatch ``j`` on the ``j``-th batch given to
    :func:`run_pipeline_step`, whose placeholders belong to ``llm_samples[j]``, in that order. A sample whose
    LLM microbatch is later than its encoder microbatch is *deferred*: the first LLM stage buffers the features
    of its encoder microbatch from that microbatch's ``F`` to the ``F`` of its LLM microbatch.

    Attributes:
        encoder_batches: per microbatch, the batch the encoder stages run (None: no item in it).
        encoder_samples: per microbatch, the keys (distinct ints, e.g. positions in the global batch) of the
            samples of the encoder view, in item order.
        llm_samples: per microbatch, the keys of the samples of the LLM view, in row-major placeholder order.
        features: per sample key, per encoder branch, its projected feature rows (= its placeholder tokens of
            that branch; a missing branch means 0).

    Raises:
        ValueError: on views of different lengths, a sample listed twice in one view or in one view only, a
            sample whose LLM microbatch precedes its encoder microbatch, or a sample without ``features``.
    """

    encoder_batches: tuple[Batch | None, ...]
    encoder_samples: tuple[tuple[int, ...], ...]
    llm_samples: tuple[tuple[int, ...], ...]
    features: Mapping[int, Mapping[str, int]]

    def __post_init__(self) -> None:
        for name in ("encoder_batches", "encoder_samples", "llm_samples"):
            value = getattr(self, name)
            object.__setattr__(self, name, tuple(value if name == "encoder_batches" else map(tuple, value)))
        m = len(self.encoder_samples)
        if len(self.encoder_batches) != m or len(self.llm_samples) != m:
            raise ValueError(f"FeatureRouting: encoder_batches ({len(self.encoder_batches)}), encoder_samples ({m}) "
                             f"and llm_samples ({len(self.llm_samples)}) need one entry per microbatch")
        enc, llm = _view_index(self.encoder_samples, "encoder_samples"), _view_index(self.llm_samples, "llm_samples")
        if set(enc) != set(llm):
            raise ValueError(f"FeatureRouting: samples {sorted(set(enc) ^ set(llm))[:5]} are in one view only")
        for key, i in enc.items():
            if llm[key] < i:
                raise ValueError(f"FeatureRouting: sample {key} has encoder microbatch {i} but LLM microbatch "
                                 f"{llm[key]}; deferral only moves LLM work later")
            if key not in self.features:
                raise ValueError(f"FeatureRouting: sample {key} has no features entry")

    @property
    def num_microbatches(self) -> int:
        """``M``, microbatches in each view."""
        return len(self.encoder_samples)

    @cached_property
    def encoder_of(self) -> dict[int, int]:
        """``{sample key: encoder microbatch}``."""
        return _view_index(self.encoder_samples, "encoder_samples")

    @cached_property
    def rows(self) -> dict[int, dict[str, tuple[int, int]]]:
        """Per sample key, per branch with features, its ``(start, stop)`` rows in the features ``[rows, hidden]``
        of its encoder microbatch."""
        out: dict[int, dict[str, tuple[int, int]]] = {}
        for samples in self.encoder_samples:
            start: dict[str, int] = defaultdict(int)
            for key in samples:
                out[key] = {}
                for branch, n in self.features[key].items():
                    if n:
                        out[key][branch] = (start[branch], start[branch] + int(n))
                        start[branch] += int(n)
        return out

    @cached_property
    def sources(self) -> tuple[tuple[int, ...], ...]:
        """Per LLM microbatch ``j``, the encoder microbatches (ascending, all ``<= j``) of its samples."""
        return tuple(tuple(sorted({self.encoder_of[k] for k in samples})) for samples in self.llm_samples)

    @cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """Per encoder microbatch ``i``, the LLM microbatches (ascending, all ``>= i``) that read its samples."""
        out: list[list[int]] = [[] for _ in self.encoder_samples]
        for j, srcs in enumerate(self.sources):
            for i in srcs:
                out[i].append(j)
        return tuple(tuple(u) for u in out)

    @property
    def defers(self) -> bool:
        """Whether some sample's LLM microbatch is later than its encoder microbatch."""
        return any(self.encoder_of[k] != j for j, samples in enumerate(self.llm_samples) for k in samples)


def _view_index(view: Sequence[Sequence[int]], name: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for i, samples in enumerate(view):
        for key in samples:
            if key in out:
                raise ValueError(f"FeatureRouting.{name}: sample {key} is in microbatches {out[key]} and {i}")
            out[key] = i
    return out


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies (fp32) over positions whose label is not -100.

    Args:
        logits: ``[B, N, V]``; labels: ``[B, N]`` already shifted (label t is the target of position t).
    Returns:
        a scalar; 0 (with a graph) when there is no target. The loss of every plait training path.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")


# ----- messages ----------------------------------------------------------------------------------------
def _encode_header(modules: Sequence[str], payload: Mapping[str, Sequence[torch.Tensor | None]]) -> list[int]:
    body: list[int] = []
    for module in modules:
        tensors = payload.get(module, [])
        body.append(len(tensors))
        for t in tensors:
            body += [-1] if t is None else [t.dim(), _DTYPES.index(t.dtype), int(t.requires_grad), *t.shape]
    return [len(body) + 1, *body]


_TensorSpec = tuple[torch.dtype, list[int], bool]  # dtype, shape, requires_grad (the sender has a graph)


def _decode_header(modules: Sequence[str], header: Sequence[int]) -> dict[str, list[_TensorSpec | None]]:
    out: dict[str, list[_TensorSpec | None]] = {}
    pos = 1
    for module in modules:
        count, pos = header[pos], pos + 1
        specs: list[_TensorSpec | None] = []
        for _ in range(count):
            ndim = header[pos]
            if ndim < 0:
                specs.append(None)
                pos += 1
                continue
            specs.append((_DTYPES[header[pos + 1]], list(header[pos + 3 : pos + 3 + ndim]), bool(header[pos + 2])))
            pos += 3 + ndim
        out[module] = specs
    return out


_MIN_CAPACITY = 1 << 16  # bytes of the first pre-posted receive of a channel (gloo packed messages)
# Per default process group: bytes a packed message may put in its pre-posted receive, per (sender, receiver)
# global ranks. Sender and receiver grow it by the same rule from the same messages, so they always agree.
_CAPACITY: weakref.WeakKeyDictionary[Any, dict[tuple[int, int], int]] = weakref.WeakKeyDictionary()


def _capacity(src: int, dst: int) -> int:
    return _CAPACITY.setdefault(dist.group.WORLD, {}).get((src, dst), _MIN_CAPACITY)


def _grow_capacity(src: int, dst: int, total: int) -> None:
    """After a message of ``total`` bytes from ``src`` to ``dst``: room for it (next power of two) from now on."""
    table = _CAPACITY.setdefault(dist.group.WORLD, {})
    table[(src, dst)] = max(table.get((src, dst), _MIN_CAPACITY), 1 << max(0, total - 1).bit_length())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def _pack(header: list[int], tensors: Sequence[torch.Tensor], capacity: int) -> torch.Tensor:
    """One uint8 buffer: int64 ``[total bytes, bytes of the first part, *header]``, then each tensor's bytes
    (8-byte aligned). The first ``min(total, capacity)`` bytes fill the receiver's pre-posted receive."""
    head = 8 * (2 + len(header))
    total = head + sum(_aligned(t.numel() * t.element_size()) for t in tensors)
    buf = torch.empty(total, dtype=torch.uint8)
    buf[:head].view(torch.int64).copy_(torch.tensor([total, min(total, capacity), *header], dtype=torch.int64))
    offset = head
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        buf[offset : offset + nbytes].copy_(t.reshape(-1).view(torch.uint8))
        offset += _aligned(nbytes)
    return buf


def _unpack(buf: torch.Tensor, modules: Sequence[str]) -> dict[str, list[torch.Tensor | None]]:
    """The payload of a :func:`_pack` buffer: tensors are views of ``buf`` (no copy)."""
    ints = buf[:16].view(torch.int64).tolist()
    header_len = int(buf[16:24].view(torch.int64).item())
    header = buf[16 : 16 + 8 * header_len].view(torch.int64).tolist()
    offset = 16 + 8 * header_len
    out: dict[str, list[torch.Tensor | None]] = {}
    for module, specs in _decode_header(modules, header).items():
        out[module] = []
        for spec in specs:
            if spec is None:
                out[module].append(None)
                continue
            dtype, shape, grad = spec
            t = torch.empty(shape, dtype=dtype)
            if t.numel():
                nbytes = t.numel() * t.element_size()
                t = buf[offset : offset + nbytes].view(dtype).view(shape)
                offset += _aligned(nbytes)
            out[module].append(t.requires_grad_(grad))
    if offset != ints[0]:
        raise RuntimeError(f"pipeline message of {ints[0]} bytes decoded to {offset} bytes: header and payload "
                           "disagree")
    return out


class _Transport:
    """Ordered P2P messages between the ranks of one pipeline (see the module docstring)."""

    def __init__(self, comm: PipelineComm, schedule: Schedule) -> None:
        self.comm, self.plan = comm, schedule.plan
        self.pending: list[tuple[Any, list[torch.Tensor]]] = []
        self.expected: dict[int, deque[_MessageKey]] = defaultdict(deque)
        self.arrived: dict[_MessageKey, dict[str, list[torch.Tensor | None]]] = {}
        self.posted: dict[int, tuple[torch.Tensor, Any]] = {}  # packed: pipeline rank -> pre-posted receive
        for src, actions in enumerate(schedule.actions):
            for action in actions:
                for key in _messages(self.plan, action):
                    if self.plan.stages[key[2]].rank == comm.pp_rank and src != comm.pp_rank:
                        self.expected[src].append(key)
        self.packed = comm.device.type == "cpu" and dist.get_backend() == "gloo"
        if self.packed:
            for src in self.expected:
                self._post(src)

    def modules_of(self, key: _MessageKey) -> tuple[str, ...]:
        """Modules of a message's payload: the sender's for activations, the receiver's for gradients."""
        return self.plan.stages[key[1] if key[0] == "F" else key[2]].modules

    def send(self, key: _MessageKey, payload: Mapping[str, Sequence[torch.Tensor | None]]) -> None:
        """Post the message (header and tensors) without waiting for it."""
        peer = self.comm.pp_ranks[self.plan.stages[key[2]].rank]
        header = _encode_header(self.modules_of(key), payload)
        tensors = [t.detach().contiguous() for m in self.modules_of(key) for t in payload.get(m, []) if t is not None]
        tensors = [t for t in tensors if t.numel()]
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
        me = self.comm.pp_ranks[self.comm.pp_rank]
        buf = _pack(header, tensors, _capacity(me, peer))
        first = int(buf[8:16].view(torch.int64).item())
        _grow_capacity(me, peer, buf.numel())
        return [[buf[:first]], [buf[first:]] if buf.numel() > first else []]

    def receive(self, key: _MessageKey) -> dict[str, list[torch.Tensor | None]]:
        """The payload of message ``key``, receiving (and buffering) earlier messages of its channel first."""
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
        sender's ``isend`` then finds it and writes the bytes at once. A receive posted after the send would
        have to wait for gloo's background thread on the sender, which gets no core while the sender computes
        (milliseconds; bench/sim_vs_measured.py)."""
        peer = self.comm.pp_ranks[src]
        buf = torch.empty(_capacity(peer, self.comm.pp_ranks[self.comm.pp_rank]), dtype=torch.uint8)
        self.posted[src] = (buf, dist.irecv(buf, peer))

    def _receive_packed(self, key: _MessageKey, src: int) -> dict[str, list[torch.Tensor | None]]:
        peer, me = self.comm.pp_ranks[src], self.comm.pp_ranks[self.comm.pp_rank]
        buf, work = self.posted.pop(src)
        work.wait()
        total, first = buf[:16].view(torch.int64).tolist()
        if total > first:  # the message outgrew the pre-posted receive: its rest follows
            full = torch.empty(total, dtype=torch.uint8)
            full[:first].copy_(buf[:first])
            self._recv([full[first:]], peer)
            buf = full
        _grow_capacity(peer, me, total)
        if self.expected[src]:
            self._post(src)
        return _unpack(buf[:total], self.modules_of(key))

    def _receive_one(self, key: _MessageKey, src: int) -> dict[str, list[torch.Tensor | None]]:
        peer = self.comm.pp_ranks[src]
        first = torch.zeros(HEADER_SLOTS, dtype=torch.long, device=self.comm.device)
        self._recv([first], peer)
        header = first.tolist()
        if header[0] > HEADER_SLOTS:
            rest = torch.zeros(header[0] - HEADER_SLOTS, dtype=torch.long, device=self.comm.device)
            self._recv([rest], peer)
            header += rest.tolist()
        specs = _decode_header(self.modules_of(key), header)
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
        """Wait for every posted send (end of the step)."""
        for works, _ in self.pending:
            for work in works:
                work.wait()
        self.pending.clear()
        if self.posted:
            raise RuntimeError(f"pipeline rank {self.comm.pp_rank}: receives posted for messages never taken from "
                               f"ranks {sorted(self.posted)}")


def _messages(plan: Any, action: Action) -> list[_MessageKey]:
    """Messages ``action`` sends to other ranks, in the order the runtime posts them."""
    s, m, rank = action.stage, action.microbatch, plan.stages[action.stage].rank
    if action.kind == "F":
        return [("F", s, t, m) for t in plan.successors(s) if plan.stages[t].rank != rank]
    if action.kind == "B":
        return [("B", s, p, m) for p in plan.predecessors(s)
                if plan.stages[p].runs_backward and plan.stages[p].rank != rank]
    return []


# ----- execution ---------------------------------------------------------------------------------------
@dataclass
class _Record:
    """What a stage keeps of one microbatch between its forward and its last backward action."""

    inputs: dict[int, Payload]
    outputs: Payload
    out_grads: list[tuple[torch.Tensor, torch.Tensor]] | None = None


_Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (output, its gradient) to back-propagate


class _FeatureBuffer:
    """The first LLM stage's view of a :class:`FeatureRouting`: the features each encoder predecessor sent for
    encoder microbatch ``i``, kept until the forward of the last LLM microbatch that reads them."""

    def __init__(self, routing: FeatureRouting) -> None:
        self.routing = routing
        self.held: dict[tuple[int, int], Mapping[str, list[torch.Tensor]]] = {}
        self.left = {i: set(users) for i, users in enumerate(routing.users)}
        self.peak = 0

    def route(self, p: int, j: int, payload: Mapping[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        """Keep encoder microbatch ``j``'s features from stage ``p``; return, per branch, the features of LLM
        microbatch ``j``'s samples in placeholder order (``[rows, hidden]``, ``requires_grad`` when a source had
        a graph; ``[]`` when none of them has that branch)."""
        self._check_rows(p, j, payload)
        self.held[(p, j)] = payload
        out: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad():
            for module in payload:
                parts, grad = [], False
                for key in self.routing.llm_samples[j]:
                    span = self.routing.rows[key].get(module)
                    if span is None:
                        continue
                    i = self.routing.encoder_of[key]
                    if (p, i) not in self.held:
                        raise RuntimeError(f"LLM microbatch {j} reads encoder microbatch {i} of stage {p} before its "
                                           "forward: the schedule must run each stage's F in microbatch order")
                    source = self.held[(p, i)][module][0]
                    parts.append(source[span[0] : span[1]])
                    grad |= source.requires_grad
                out[module] = [torch.cat(parts).requires_grad_(grad)] if parts else []
        return out

    def _check_rows(self, p: int, i: int, payload: Mapping[str, list[torch.Tensor]]) -> None:
        for module, tensors in payload.items():
            want = sum(self.routing.rows[k].get(module, (0, 0))[1] - self.routing.rows[k].get(module, (0, 0))[0]
                       for k in self.routing.encoder_samples[i])
            got = int(tensors[0].shape[0]) if tensors else 0
            if got != want:
                raise ValueError(f"encoder microbatch {i} of stage {p}: branch {module!r} produced {got} feature rows "
                                 f"but FeatureRouting.features gives its samples {want}")

    def release(self, j: int) -> None:
        """After LLM microbatch ``j``'s forward: drop the encoder microbatches nobody reads any more, then count
        the bytes still held (for later LLM microbatches)."""
        for i in self.routing.sources[j]:
            self.left[i].discard(j)
        for p, i in list(self.held):
            if not self.left[i]:
                del self.held[(p, i)]
        held = sum(t.numel() * t.element_size() for payload in self.held.values() for ts in payload.values()
                   for t in ts)
        self.peak = max(self.peak, held)


class _Executor:
    """Runs one rank's actions of one step (state of that step only)."""

    def __init__(self, stages: RankStages, schedule: Schedule, microbatches: Sequence[Batch | None], scale: float,
                 comm: PipelineComm, loss_fn: Callable, autocast: Callable[[], AbstractContextManager],
                 llm_kwargs: Callable[[Batch], Mapping[str, Any]], instrument: bool,
                 routing: FeatureRouting | None = None) -> None:
        self.stages, self.plan, self.schedule = stages, schedule.plan, schedule
        self.mbs, self.scale, self.comm = microbatches, scale, comm
        self.loss_fn, self.autocast, self.llm_kwargs, self.instrument = loss_fn, autocast, llm_kwargs, instrument
        self.transport = _Transport(comm, schedule) if comm.distributed else None
        self.local: dict[_MessageKey, Any] = {}
        self.records: dict[tuple[int, int], _Record] = {}
        self.losses: list[torch.Tensor] = []
        self.events: list[TimelineEvent] = []
        self.saved: dict[int, int] = {s: 0 for s in stages.stages}
        self.backwards: dict[int, int] = {s: 0 for s in stages.stages}
        self.routing = routing
        self.buffer = _FeatureBuffer(routing) if routing is not None else None
        self.users_left: dict[tuple[int, int], set[int]] = {}  # routed encoder records: LLM microbatches to come
        self.shares: dict[tuple[int, int], dict[int, _Pairs]] = {}  # routed (s, j): per record i, its pairs

    def run(self) -> None:
        for action in self.schedule.actions[self.comm.pp_rank]:
            if action.kind == "F":
                self._forward(action.stage, action.microbatch)
            elif self._routed(action.stage):
                self._backward_routed(action)
            else:
                self._backward(action)
        if self.transport is not None:
            self.transport.finish()

    def _routed(self, s: int) -> bool:
        """An encoder stage under a routing: its microbatch ``i`` is the encoder view's."""
        return self.routing is not None and LLM_MODULE not in self.stages.stages[s].chunks

    # -- transfers
    def _take(self, key: _MessageKey) -> Any:
        if key in self.local:
            return self.local.pop(key)
        if self.transport is None:
            raise RuntimeError(f"message {key} crosses ranks but torch.distributed is not initialised")
        return self.transport.receive(key)

    def _give(self, key: _MessageKey, payload: Mapping[str, Sequence[torch.Tensor | None]]) -> None:
        if self.plan.stages[key[2]].rank == self.comm.pp_rank:
            self.local[key] = {m: [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in lst]
                               for m, lst in payload.items()}
        else:
            assert self.transport is not None  # a remote stage implies a process group (checked in _take)
            self.transport.send(key, payload)

    # -- forward
    def _forward(self, s: int, m: int) -> None:
        stage: PipelineStage = self.stages.stages[s]
        received = {p: self._take(("F", p, s, m)) for p in self.plan.predecessors(s)}
        start = time.time()
        if self.buffer is not None and LLM_MODULE in stage.chunks:
            received = {p: payload if self.plan.stages[p].is_llm else self.buffer.route(p, m, payload)
                        for p, payload in received.items()}
            if any(not self.plan.stages[p].is_llm for p in received):
                self.buffer.release(m)
        leaves = {p: self._leaves(p, stage, payload) for p, payload in received.items()}
        routed = self._routed(s)
        batch = self.routing.encoder_batches[m] if routed else self.mbs[m]  # type: ignore[union-attr]
        keeps = self.plan.stages[s].runs_backward and not (routed and not self.routing.users[m])  # type: ignore
        kwargs = self.llm_kwargs(batch) if batch is not None and not routed else {}
        if LLM_MODULE in stage.chunks and batch is not None:
            _check_cp_kwargs(kwargs, self.comm, s, m)
        with torch.set_grad_enabled(keeps), self.autocast(), self._counting(s):
            out = stage.forward(batch, leaves, self.loss_fn, kwargs)
        if keeps:
            self.records[(s, m)] = _Record(leaves, out)
            if routed:
                self.users_left[(s, m)] = set(self.routing.users[m])  # type: ignore[union-attr]
        if stage.is_last and out["llm"]:
            self.losses.append(out["llm"][0].detach())
        for t in self.plan.successors(s):
            self._give(("F", s, t, m), out)
        self.events.append(TimelineEvent(self.comm.pp_rank, "F", s, m, start, time.time()))

    def _leaves(self, p: int, stage: PipelineStage, payload: Mapping[str, list]) -> Payload:
        """Received tensors as fresh graph leaves. One requires a gradient when its sender stage runs backward
        and had a graph for it this microbatch (``requires_grad`` travels with the tensor), and the chunk that
        consumes it records a graph."""
        grad = self.plan.stages[p].runs_backward
        out: Payload = {}
        for module, tensors in payload.items():
            wants = grad and stage.module_runs_grad(module if module in stage.chunks else "llm")
            out[module] = [t.detach().requires_grad_(wants and t.requires_grad and t.is_floating_point())
                           for t in tensors]
        return out

    def _counting(self, s: int) -> AbstractContextManager:
        if not self.instrument:
            return nullcontext()

        def pack(t: torch.Tensor) -> torch.Tensor:
            self.saved[s] += 1
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    # -- backward
    def _backward(self, action: Action) -> None:
        s, m = action.stage, action.microbatch
        record = self.records[(s, m)]
        if record.out_grads is None:
            record.out_grads = self._output_grads(s, m, record)
        start = time.time()
        with self.autocast():
            if action.kind == "W":
                ran = self._weight_grads(s, record.out_grads)
            elif self.schedule.split_backward:
                ran = self._input_grads(record, record.out_grads)
            else:
                ran = self._fused_backward(record.out_grads, retain=False)
        self.backwards[s] += int(ran)
        if action.kind == "B":
            for p in self.plan.predecessors(s):
                if self.plan.stages[p].runs_backward:
                    self._give(("B", s, p, m), _input_grad_payload(record.inputs[p]))
        if frees_activations(self.plan, action, self.schedule.split_backward):
            del self.records[(s, m)]
        self.events.append(TimelineEvent(self.comm.pp_rank, action.kind, s, m, start, time.time()))

    def _output_grads(self, s: int, m: int, record: _Record) -> _Pairs:
        """``(output, gradient)`` pairs to backpropagate (the scaled loss on the last stage)."""
        if self.stages.stages[s].is_last:
            if not record.outputs["llm"]:
                return []  # an LLM microbatch without samples (all deferred)
            loss = record.outputs["llm"][0]
            return [(loss, torch.full_like(loss, self.scale))] if loss.requires_grad else []
        (t,) = self.plan.successors(s)
        grads = self._take(("B", t, s, m))
        pairs = []
        for module, outs in record.outputs.items():
            for out, grad in zip(outs, grads.get(module, [])):
                if grad is not None and out.requires_grad:
                    pairs.append((out, grad))
        return pairs

    def _fused_backward(self, pairs: _Pairs, retain: bool) -> bool:
        if not pairs:
            return False
        outs, grads = zip(*pairs)
        torch.autograd.backward(list(outs), list(grads), retain_graph=retain)
        return True

    def _input_grads(self, record: _Record, pairs: _Pairs) -> bool:
        leaves = [t for payload in record.inputs.values() for lst in payload.values() for t in lst if t.requires_grad]
        if not (leaves and pairs):
            return False
        outs, grads = zip(*pairs)
        found = torch.autograd.grad(list(outs), leaves, list(grads), retain_graph=True, allow_unused=True)
        for leaf, grad in zip(leaves, found):
            leaf.grad = grad
        return True

    def _weight_grads(self, s: int, pairs: _Pairs, retain: bool = False) -> bool:
        params = [p for p in self.stages.stages[s].params if p.requires_grad]
        if not (params and pairs):
            return False
        outs, grads = zip(*pairs)
        found = torch.autograd.grad(list(outs), params, list(grads), retain_graph=retain, allow_unused=True)
        for param, grad in zip(params, found):
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad + grad
        return True

    # -- backward of an encoder stage under a FeatureRouting
    def _backward_routed(self, action: Action) -> None:
        """``B``/``W`` of encoder stage ``s`` for LLM microbatch ``j`` under a :class:`FeatureRouting`.

        The output gradients that arrive for ``j`` belong to ``j``'s samples, whose activations live in the
        records of their encoder microbatches ``routing.sources[j]``: each such record is back-propagated with
        its share (linearity: the shares of all its LLM microbatches sum to its whole output gradient), its graph
        retained while another LLM microbatch still has to bring gradients for it. The input gradients sent
        upstream are, per record in ``sources[j]`` order, that record's partial input gradients.
        """
        s, j = action.stage, action.microbatch
        routing = self.routing
        assert routing is not None  # _routed(s)
        if (s, j) not in self.shares:
            self.shares[(s, j)] = self._routed_output_grads(s, j)
        last = frees_activations(self.plan, action, self.schedule.split_backward)
        start, ran = time.time(), False
        with self.autocast():
            for i, pairs in self.shares[(s, j)].items():
                record = self.records[(s, i)]
                retain = not last or bool(self.users_left[(s, i)] - {j})
                if action.kind == "W":
                    ran |= self._weight_grads(s, pairs, retain)
                    continue
                _clear_leaf_grads(record)  # the leaves' grads must be this j's share only
                if self.schedule.split_backward:
                    ran |= self._input_grads(record, pairs)
                else:
                    ran |= self._fused_backward(pairs, retain)
        self.backwards[s] += int(ran)
        if action.kind == "B":
            self._send_routed_input_grads(s, j)
        if last:
            del self.shares[(s, j)]
            for i in routing.sources[j]:
                self.users_left[(s, i)].discard(j)
                if not self.users_left[(s, i)]:
                    del self.records[(s, i)], self.users_left[(s, i)]
        self.events.append(TimelineEvent(self.comm.pp_rank, action.kind, s, j, start, time.time()))

    def _routed_output_grads(self, s: int, j: int) -> dict[int, _Pairs]:
        """Per encoder microbatch ``i`` of ``routing.sources[j]``, the ``(output, gradient)`` pairs of its record
        that LLM microbatch ``j``'s gradient message covers."""
        routing = self.routing
        assert routing is not None
        (t,) = self.plan.successors(s)
        grads = self._take(("B", t, s, j))
        shares: dict[int, _Pairs] = {i: [] for i in routing.sources[j]}
        for module, tensors in grads.items():
            if self.plan.stages[t].is_llm:
                if tensors and tensors[0] is not None:
                    self._split_feature_grad(s, j, module, tensors[0], shares)
                continue
            pos = 0
            for i in routing.sources[j]:
                outs = self.records[(s, i)].outputs.get(module, [])
                for out, grad in zip(outs, tensors[pos : pos + len(outs)]):
                    if grad is not None and out.requires_grad:
                        shares[i].append((out, grad))
                pos += len(outs)
        return shares

    def _split_feature_grad(self, s: int, j: int, module: str, grad: torch.Tensor,
                            shares: dict[int, _Pairs]) -> None:
        """Cut the gradient of LLM microbatch ``j``'s features ``[rows, hidden]`` (placeholder order) per sample
        and place each piece at the sample's rows of its encoder microbatch's features (zeros elsewhere)."""
        routing = self.routing
        assert routing is not None
        full: dict[int, torch.Tensor] = {}
        offset = 0
        for key in routing.llm_samples[j]:
            span = routing.rows[key].get(module)
            if span is None:
                continue
            i, n = routing.encoder_of[key], span[1] - span[0]
            out = self.records[(s, i)].outputs[module][0]
            if out.requires_grad:
                if i not in full:
                    full[i] = torch.zeros_like(out)
                full[i][span[0] : span[1]] = grad[offset : offset + n]
            offset += n
        if offset != grad.shape[0]:
            raise RuntimeError(f"stage {s}, LLM microbatch {j}: {grad.shape[0]} feature gradient rows for "
                               f"{module!r}, the routing gives {offset}")
        for i, g in full.items():
            shares[i].append((self.records[(s, i)].outputs[module][0], g))

    def _send_routed_input_grads(self, s: int, j: int) -> None:
        """Per predecessor that runs backward: per module, the input gradients of the records of
        ``routing.sources[j]``, concatenated in that order (the receiver splits them by its own records)."""
        routing = self.routing
        assert routing is not None
        for p in self.plan.predecessors(s):
            if not self.plan.stages[p].runs_backward:
                continue
            payload: dict[str, list[torch.Tensor | None]] = defaultdict(list)
            for i in routing.sources[j]:
                for module, grads in _input_grad_payload(self.records[(s, i)].inputs[p]).items():
                    payload[module] += grads
            self._give(("B", s, p, j), dict(payload))


def _clear_leaf_grads(record: _Record) -> None:
    for payload in record.inputs.values():
        for tensors in payload.values():
            for t in tensors:
                t.grad = None


def _check_cp_kwargs(kwargs: Mapping[str, Any], comm: PipelineComm, s: int, m: int) -> None:
    """An LLM stage under context parallelism needs this rank's ``plait_cp`` shard over ``comm.cp_group``:
    without it every CP rank would run all tokens and the gradient sum over CP would count them ``cp`` times."""
    shard = kwargs.get("plait_cp")
    cp = 1 if shard is None else shard.cp
    if cp != comm.cp_size or (shard is not None and shard.rank != comm.cp_rank):
        got = "no plait_cp shard" if shard is None else f"a plait_cp shard of rank {shard.rank} of cp={cp}"
        raise ValueError(f"LLM stage {s}, microbatch {m}: llm_kwargs gave {got}, but this rank is CP rank "
                         f"{comm.cp_rank} of cp={comm.cp_size}")


def _input_grad_payload(inputs: Payload) -> dict[str, list[torch.Tensor | None]]:
    return {m: [t.grad if t.requires_grad else None for t in lst] for m, lst in inputs.items()}


# ----- gradient reduction --------------------------------------------------------------------------------
def _reduce_dp(params: Sequence[torch.nn.Parameter], comm: PipelineComm) -> None:
    """Sum gradients over every copy of this rank's stages: the DP replicas and, with context parallelism, the
    CP ranks (each CP rank's gradients come from its own tokens only: the LLM's queries, the K/V it holds, and
    the features the encoders produced for its tokens; their sum is the whole microbatch's gradient). A
    parameter without a gradient on every copy keeps ``None`` (as in one process: the optimizer skips it); one
    used on some copy gets zeros where it was unused."""
    if comm.stage_replicas == 1 or not params:
        return
    sum_gradients(params, comm.reduce_group, comm.device)


def _sum_tied(stages: RankStages, comm: PipelineComm) -> None:
    """Sum the gradients of tied input/output embedding copies held by two pipeline ranks."""
    tied = stages.tied
    if tied is None:
        return
    param = tied.param
    mine = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
    other = torch.empty_like(mine)
    peer = comm.pp_ranks[tied.peer]
    ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, other, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    param.grad = mine + other if tied.mirror else other + mine  # same operand order on both ranks


def run_pipeline_step(
    stages: RankStages,
    schedule: Schedule,
    microbatches: Sequence[Batch | None],
    global_targets: int,
    comm: PipelineComm | None = None,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    llm_kwargs: Callable[[Batch], Mapping[str, Any]] | None = None,
    instrument: bool = False,
    routing: FeatureRouting | None = None,
) -> PipelineStepResult:
    """Forward and backward of this pipeline's ``M`` microbatches of a global batch, then gradient reduction.

    Gradients accumulate into ``.grad`` of this rank's parameters: summed over the DP x CP copies of its
    stages, and over the two copies of tied embeddings split across ranks; the caller then steps its optimizer
    (if the rank trains) and zeroes them. Collective: every rank of the job calls it with the same schedule.

    Context parallelism (``comm.cp_size`` > 1): every CP rank of a pipeline runs the same schedule on the same
    microbatches; ``llm_kwargs`` must give each microbatch this rank's ``plait_cp`` shard (a
    :class:`~plait.parallel.context.CPShard` over ``comm.cp_group``, the same token assignment on every rank)
    with its ``plait_mask``. Encoder stages run whole; the LLM stages keep only the shard's tokens (see
    :class:`~plait.parallel.stages.PipelineStage`), so LLM messages carry ``[B, n_local, H]``.

    Args:
        stages: this rank's stages (``build_rank_stages``); their plan must be ``schedule.plan``.
        schedule: the pipeline schedule (e.g. ``one_f_one_b(plan, M)``).
        microbatches: this pipeline's ``M`` microbatches (the DP replica's share of the global batch), the
            same list on every rank of the pipeline; tensors on ``comm.device``.
        global_targets: target tokens of the whole global batch (all microbatches of all DP replicas).
        comm: PP/DP coordinates (default: single process, every stage on pipeline rank 0).
        loss_fn: ``(logits [B, N, V], labels [B, N]) -> scalar`` sum of token losses.
        autocast: context factory wrapped around every action (e.g. bf16 autocast).
        llm_kwargs: extra keyword arguments for the LLM stages per microbatch (attention metadata:
            ``plait_mask``, and ``plait_cp`` with context parallelism).
        instrument: count tensors saved for backward per stage (``saved_tensors_hooks``).
        routing: deferred encoder outputs (:class:`FeatureRouting`): encoder stages then run microbatch ``i`` on
            ``routing.encoder_batches[i]`` and ``microbatches`` is the LLM view (``None`` for an LLM microbatch
            without samples). The schedule and its messages are unchanged: ``F`` of the last stage of a branch
            sends its encoder microbatch's features; the first LLM stage buffers them per encoder microbatch
            (counted in ``buffered_peak_bytes``) and assembles each LLM microbatch's features from the buffers
            of its samples' encoder microbatches (never later ones); its ``B`` sends the gradient of the features
            it used, and the encoder stages' ``B``/``W`` of microbatch ``j`` back-propagate exactly that gradient
            through the graphs of the encoder microbatches that produced them (``_Executor._backward_routed``).
            ``None``: both views are ``microbatches`` (the original path).

    Returns:
        :class:`PipelineStepResult` (loss the same on every rank).

    Raises:
        ValueError: on a wrong microbatch count (in ``microbatches`` or ``routing``), a ``None`` microbatch
            without ``routing``, features that do not match ``routing.features``, a schedule for another plan,
            a negative target count, or (at
            an LLM stage's first forward) ``llm_kwargs`` without this CP rank's ``plait_cp`` shard when
            ``comm.cp_size`` > 1 (or with a shard when it is 1).
    """
    comm = comm or PipelineComm()
    _check_step_inputs(stages, schedule, microbatches, global_targets, comm)
    _check_routing(routing, microbatches)
    executor = _Executor(stages, schedule, microbatches, 1.0 / max(1, global_targets), comm, loss_fn, autocast,
                         llm_kwargs or (lambda batch: {}), instrument, routing)
    executor.run()
    params = [p for _, p in stages.trainable_parameters()]
    _reduce_dp(params, comm)
    if comm.distributed:
        _sum_tied(stages, comm)
    loss_sum = torch.zeros((), dtype=torch.float64, device=comm.device)
    for loss in executor.losses:
        loss_sum += loss.double().to(comm.device)
    if comm.distributed:
        dist.all_reduce(loss_sum)  # last-stage ranks hold losses (per CP rank: its tokens'): the world sum
    total = float(loss_sum)
    return PipelineStepResult(total / max(1, global_targets), total, tuple(executor.events),
                              executor.saved if instrument else {}, executor.backwards,
                              executor.buffer.peak if executor.buffer is not None else 0)


def _check_routing(routing: FeatureRouting | None, microbatches: Sequence[Batch | None]) -> None:
    if routing is None:
        missing = [j for j, b in enumerate(microbatches) if b is None]
        if missing:
            raise ValueError(f"microbatches {missing} are None: only a FeatureRouting allows empty LLM microbatches")
    elif routing.num_microbatches != len(microbatches):
        raise ValueError(f"the routing has {routing.num_microbatches} microbatches, {len(microbatches)} were given")


def _check_step_inputs(stages: RankStages, schedule: Schedule, microbatches: Sequence[Batch | None],
                       global_targets: int, comm: PipelineComm) -> None:
    if schedule.plan != stages.plan:
        raise ValueError("the schedule was made for another pipeline plan than the stages")
    if len(microbatches) != schedule.num_microbatches:
        raise ValueError(
            f"the schedule runs {schedule.num_microbatches} microbatches but {len(microbatches)} were given"
        )
    if global_targets < 0:
        raise ValueError(f"global_targets must be >= 0, got {global_targets}")
    if comm.pp_rank != stages.pp_rank or len(comm.pp_ranks) != schedule.num_ranks:
        raise ValueError(
            f"comm has pipeline rank {comm.pp_rank} of {len(comm.pp_ranks)} but the stages are for rank "
            f"{stages.pp_rank} of a {schedule.num_ranks}-rank schedule"
        )


def clip_grad_norm_pipeline(stages: RankStages, max_norm: float, comm: PipelineComm | None = None) -> float:
    """Clip the gradients of the whole pipeline to a global L2 norm of ``max_norm``; returns the norm before
    clipping (the same on every rank). Call after :func:`run_pipeline_step` (gradients already summed over the
    DP x CP copies of each stage, so every copy holds the same ones and the world sum of squares is divided by
    their number; a tied embedding copy counts once). Collective.

    Raises:
        ValueError: on a negative ``max_norm``.
    """
    if max_norm < 0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")
    comm = comm or PipelineComm()
    mirror = stages.tied.param if stages.tied is not None and stages.tied.mirror else None
    grads = [p.grad for _, p in stages.trainable_parameters() if p.grad is not None]
    counted = [p.grad for _, p in stages.trainable_parameters() if p.grad is not None and p is not mirror]
    sumsq = torch.zeros((), dtype=torch.float64, device=comm.device)
    for g in counted:
        sumsq += g.detach().double().pow(2).sum()
    if comm.distributed:
        dist.all_reduce(sumsq)
        sumsq /= comm.stage_replicas
    norm = float(sumsq.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def gather_timeline(events: Sequence[TimelineEvent], comm: PipelineComm | None = None) -> list[TimelineEvent]:
    """The events of every pipeline rank of DP replica 0 and CP rank 0 on global rank 0 (other ranks get
    ``[]``), for
    ``plait.train.plots.write_chrome_trace``/``plot_timeline``. Collective."""
    comm = comm or PipelineComm()
    if not comm.distributed:
        return list(events)
    mine = [e.to_dict() for e in events] if comm.dp_rank == 0 and comm.cp_rank == 0 else []
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return []
    return [TimelineEvent.from_dict(e) for part in gathered for e in part]
