"""The cost room's value types: the device, optimizer, host and parallel degrees a cost is computed for, and
the estimates and memory figures it returns.

Frozen dataclasses that round-trip through JSON (``serialize.JsonDataclass``), with the value domains they
check (``FSDP_RESHARD``, ``CHECKPOINT_POLICIES``, ...) and ``dtype_bytes``, the bytes per element of a dtype
name they read. The functions computing with them live in ``analytic``, ``sharding``, ``offload`` and
``recompute``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plait.planner.serialize import JsonDataclass
from plait.planner.types import UnitCost

__all__ = [
    "CHECKPOINT_POLICIES",
    "CPU_CHUNK_OVERHEAD_S",
    "CPU_MESSAGE_OVERHEAD_S",
    "FSDP_REDUCE",
    "FSDP_RESHARD",
    "ActionOverheads",
    "DeviceSpec",
    "GradAccumulation",
    "HostSpec",
    "MicrobatchShape",
    "OffloadCost",
    "OptimizerSpec",
    "ParallelDegrees",
    "ProfileKey",
    "RankMemory",
    "UnitEstimate",
    "dtype_bytes",
]

_DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4, "tf32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


@dataclass(frozen=True)
class DeviceSpec(JsonDataclass):
    """One accelerator (or CPU) as the roofline sees it.

    Attributes:
        name: label for plots and reports.
        peak_flops: dense bf16 peak (FLOP/s).
        efficiency: fraction of ``peak_flops`` reached by matmuls in training (MFU-like, in (0, 1]).
        memory_bytes: device memory (bytes).
        hbm_bandwidth: device memory bandwidth (B/s).
        link_bandwidth: point-to-point bandwidth to a pipeline neighbour, one direction (B/s).
        link_latency: per-message latency of that link (s).
        chunk_overhead_s: host seconds one module chunk of a stage costs per action (``F``, or ``B`` of a chunk
            that runs a backward) beyond its layers' work: the runtime's glue (rotary tables and masks of an
            LLM chunk, feature placement, the loss, Python and autograd bookkeeping). 0 on GPU presets (hidden
            behind asynchronous kernels); see ``planner.overheads.ActionOverheads``.
        message_overhead_s: host seconds each end spends per cross-rank message (LogP's ``o``: packing and
            posting, waiting and unpacking); the ``P2PModel`` send and receive overheads.

    Raises:
        ValueError: on a non-positive field, an efficiency above 1 or a negative latency or overhead.
    """

    name: str
    peak_flops: float
    efficiency: float
    memory_bytes: float
    hbm_bandwidth: float
    link_bandwidth: float
    link_latency: float = 0.0
    chunk_overhead_s: float = 0.0
    message_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for field in ("peak_flops", "efficiency", "memory_bytes", "hbm_bandwidth", "link_bandwidth"):
            if not getattr(self, field) > 0:
                raise ValueError(f"DeviceSpec.{field} must be > 0, got {getattr(self, field)}")
        if self.efficiency > 1:
            raise ValueError(f"DeviceSpec.efficiency must be <= 1, got {self.efficiency}")
        for field in ("link_latency", "chunk_overhead_s", "message_overhead_s"):
            if not getattr(self, field) >= 0:
                raise ValueError(f"DeviceSpec.{field} must be >= 0, got {getattr(self, field)}")

    def compute_time(self, flops: float, bytes_moved: float) -> float:
        """Roofline time (s): ``max(flops / (peak_flops * efficiency), bytes_moved / hbm_bandwidth)``."""
        return max(flops / (self.peak_flops * self.efficiency), bytes_moved / self.hbm_bandwidth)

    def transfer_time(self, num_bytes: float) -> float:
        """Time (s) to send ``num_bytes`` to a neighbour: ``link_latency + num_bytes / link_bandwidth``."""
        return self.link_latency + num_bytes / self.link_bandwidth

    @classmethod
    def h100(cls, efficiency: float = 0.5) -> "DeviceSpec":
        """NVIDIA H100 SXM 80 GB: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 450 GB/s per direction."""
        return cls("H100-SXM", 989e12, efficiency, 80 * 2**30, 3.35e12, 450e9, 1e-5)

    @classmethod
    def h200(cls, efficiency: float = 0.5) -> "DeviceSpec":
        """NVIDIA H200 SXM 141 GB: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e, NVLink 450 GB/s per direction."""
        return cls("H200-SXM", 989e12, efficiency, 141e9, 4.8e12, 450e9, 1e-5)

    @classmethod
    def a100(cls, efficiency: float = 0.5) -> "DeviceSpec":
        """NVIDIA A100 SXM 80 GB: 312 TFLOP/s bf16 dense, 2.04 TB/s HBM2e, NVLink 300 GB/s per direction."""
        return cls("A100-SXM-80GB", 312e12, efficiency, 80 * 2**30, 2.039e12, 300e9, 1e-5)

    @classmethod
    def cpu(cls, efficiency: float = 0.3) -> "DeviceSpec":
        """A generic many-core server CPU (rough; calibrate with the profiler): 1 TFLOP/s, 50 GB/s DRAM,
        64 GiB, shared-memory gloo link at 5 GB/s with 50 us latency; per module chunk and action 5 ms of
        runtime overhead and per message 0.1 ms at each end. The overheads are measured on a 2-core CPU with one
        thread per process: ``plait profile``'s chunk overheads (forward and backward) of the three
        ``bench/plan_holds.py`` jobs, 0-5 ms for the 2-layer job's 512-token microbatches, 1-28 ms for the demo's
        4096-token ones, up to 40 ms for the wide LLM-only job (a typical 5 ms taken), and
        ``plait.measure.link.measure_link`` (54-62 us per end for a 64 KiB message, 170-240 us for 1 MiB)."""
        return cls("CPU", 1e12, efficiency, 64 * 2**30, 50e9, 5e9, 5e-5, CPU_CHUNK_OVERHEAD_S, CPU_MESSAGE_OVERHEAD_S)


CPU_CHUNK_OVERHEAD_S = 5e-3
"""``DeviceSpec.cpu``'s ``chunk_overhead_s`` (seconds; measured, see ``DeviceSpec.cpu``)."""

CPU_MESSAGE_OVERHEAD_S = 1e-4
"""``DeviceSpec.cpu``'s ``message_overhead_s`` (seconds; measured, see ``DeviceSpec.cpu``)."""


@dataclass(frozen=True)
class MicrobatchShape(JsonDataclass):
    """Work of one module in one microbatch.

    Attributes:
        tokens: tokens through the module (all sequences / items of the microbatch). For an encoder, the
            tokens its layers see (vision: patches plus prefix tokens such as CLS; Whisper: output frames,
            1500 per 30 s clip); for the LLM, the sequence tokens after placeholder expansion.
        seq_len: tokens per sequence (LLM) or per item (encoder); ``None``: LLM one sequence of ``tokens``,
            encoder the config's native item length (e.g. ``(image_size / patch_size)^2 + 1`` for CLIP).
        attended_pairs: attended (query, key) pairs of one layer summed over the microbatch, so real
            multimodal / packed masks count exactly; ``None``: causal ``n L (L + 1) / 2`` for the LLM and
            full ``n L^2`` for encoders, with ``n = tokens / L`` sequences of length ``L``.

    Raises:
        ValueError: on a non-positive ``tokens`` / ``seq_len`` or a negative ``attended_pairs``.
    """

    tokens: int
    seq_len: int | None = None
    attended_pairs: float | None = None

    def __post_init__(self) -> None:
        if self.tokens <= 0:
            raise ValueError(f"MicrobatchShape.tokens must be > 0, got {self.tokens}")
        if self.seq_len is not None and self.seq_len <= 0:
            raise ValueError(f"MicrobatchShape.seq_len must be > 0, got {self.seq_len}")
        if self.attended_pairs is not None and self.attended_pairs < 0:
            raise ValueError(f"MicrobatchShape.attended_pairs must be >= 0, got {self.attended_pairs}")


@dataclass(frozen=True)
class OptimizerSpec(JsonDataclass):
    """Training memory per trainable parameter beyond the parameter itself.

    Attributes:
        grad_bytes_per_param: gradient bytes per parameter; ``None`` means the training dtype's size.
        state_bytes_per_param: optimizer-state bytes per parameter; 12 for AdamW with an fp32 master
            copy (4) and fp32 first (4) and second (4) moments.

    Raises:
        ValueError: on a negative field.
    """

    grad_bytes_per_param: float | None = None
    state_bytes_per_param: float = 12.0

    def __post_init__(self) -> None:
        if self.grad_bytes_per_param is not None and self.grad_bytes_per_param < 0:
            raise ValueError(f"OptimizerSpec.grad_bytes_per_param must be >= 0, got {self.grad_bytes_per_param}")
        if self.state_bytes_per_param < 0:
            raise ValueError(f"OptimizerSpec.state_bytes_per_param must be >= 0, got {self.state_bytes_per_param}")

    def grad_bytes(self, dtype: Any = "bfloat16") -> float:
        """Gradient bytes per trained parameter: ``grad_bytes_per_param``, or ``dtype``'s size when it is None."""
        return dtype_bytes(dtype) if self.grad_bytes_per_param is None else float(self.grad_bytes_per_param)


def dtype_bytes(dtype: Any) -> float:
    """Bytes per element of ``dtype``: a number (returned as is), a name (``"bfloat16"``, ``"fp32"``, ...)
    or a ``torch.dtype`` (read through its name, torch is not imported).

    Raises:
        ValueError: on an unknown name or a non-positive number.
    """
    if isinstance(dtype, (int, float)) and not isinstance(dtype, bool):
        if dtype <= 0:
            raise ValueError(f"dtype size must be > 0 bytes, got {dtype}")
        return float(dtype)
    name = str(dtype).removeprefix("torch.").lower()
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPE_BYTES)}")
    return float(_DTYPE_BYTES[name])


@dataclass(frozen=True)
class UnitEstimate(JsonDataclass):
    """Device-independent work of one unit for one microbatch shape.

    Attributes:
        params: parameter count.
        weight_flops: forward FLOPs of the weight matmuls / convolutions (= dW FLOPs).
        attention_flops: forward FLOPs of ``Q K^T`` and ``P V`` (no weights, so no dW; dX pays it twice).
        forward_bytes: bytes moved through device memory by the forward (weights read once plus each op's
            inputs read and output written).
        weight_grad_bytes: bytes moved by the dW pass.
        activation_bytes: bytes the forward saves for backward (one microbatch).
        output_bytes: bytes of the unit's output tensor (what a stage boundary after it sends).
        input_grad: whether the unit has a dX at all (False for embeddings: ids, pixels, mel frames).
        tied_params: of ``params``, those another unit holds (a tied LLM head uses the embedding matrix): they
            count in FLOPs and bytes moved, and the unit computes their dW, but their memory is the other unit's
            (``UnitCost.param_bytes`` leaves them out), so the units' parameters add up to the model's.
        expert_params: of ``params``, a mixture-of-experts layer's routed experts' (``E 3 H I_e``; expert
            parallelism divides them, ``UnitCost.expert_param_bytes``).
    """

    params: int
    weight_flops: float
    attention_flops: float
    forward_bytes: float
    weight_grad_bytes: float
    activation_bytes: float
    output_bytes: float
    input_grad: bool = True
    tied_params: int = 0
    expert_params: int = 0

    def to_cost(self, device: DeviceSpec, dtype: Any = "bfloat16") -> UnitCost:
        """Roofline ``UnitCost`` on ``device``: forward ``W + A`` FLOPs, dX ``W + 2A`` (0 if no dX),
        dW ``W`` FLOPs (0 without parameters), each against the bytes it moves; parameters held (``params`` but
        the tied ones) in ``dtype``."""
        forward = device.compute_time(self.weight_flops + self.attention_flops, self.forward_bytes)
        dx = (device.compute_time(self.weight_flops + 2 * self.attention_flops, self.forward_bytes)
              if self.input_grad else 0.0)
        dw = device.compute_time(self.weight_flops, self.weight_grad_bytes) if self.params else 0.0
        return UnitCost(
            forward_s=forward, input_grad_s=dx, weight_grad_s=dw,
            param_bytes=int(round((self.params - self.tied_params) * dtype_bytes(dtype))),
            activation_bytes=int(round(self.activation_bytes)), output_bytes=int(round(self.output_bytes)),
            expert_param_bytes=int(round(self.expert_params * dtype_bytes(dtype))),
        )


CHECKPOINT_POLICIES = ("none", "full", "selective")
"""Values of ``train.activation_checkpointing`` and of its per-module overrides."""

FSDP_REDUCE = ("step", "microbatch")
"""When FSDP2 without pipeline stages reduce-scatters the gradients (``parallel.fsdp_reduce``, module docstring)."""

FSDP_RESHARD = ("after_forward", "after_backward")
"""When FSDP2 without pipeline stages frees a unit's gathered parameters (``parallel.fsdp_reshard``, module
docstring)."""


@dataclass(frozen=True)
class ParallelDegrees(JsonDataclass):
    """The memory-saving choices of a plan beyond its pipeline layout.

    Attributes:
        tp: tensor-parallel degree (``parallel.tp``): ranks splitting each layer.
        dp_shard: FSDP2 shard degree (``parallel.dp_shard``): ranks sharing one copy of the parameters, gradients
            and optimizer state; it divides the plan's data-parallel degree (the rest is ``parallel.dp``, replicas).
        checkpointing: activation checkpointing policy (``train.activation_checkpointing``,
            ``recompute.CHECKPOINT_POLICIES``).
        fsdp_reshard: when FSDP2 without pipeline stages frees a unit's gathered parameters
            (``parallel.fsdp_reshard``, ``FSDP_RESHARD``; module docstring); no effect with ``dp_shard == 1``.
        ep: expert-parallel degree (``parallel.ep``): ranks of the LLM stages' data-parallel ranks splitting each
            MoE layer's routed experts (``cost.experts``); 1 or a divisor or multiple of ``dp_shard``.

    Raises:
        ValueError: on a degree below 1, an unknown policy or an unknown ``fsdp_reshard``, or an ``ep`` that is
            neither a divisor nor a multiple of ``dp_shard``.
    """

    tp: int = 1
    dp_shard: int = 1
    checkpointing: str = "none"
    fsdp_reshard: str = "after_forward"
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp_shard", "ep"):
            value = getattr(self, name)
            if int(value) != value or value < 1:
                raise ValueError(f"ParallelDegrees.{name} must be an integer >= 1, got {value!r}")
        if self.checkpointing not in CHECKPOINT_POLICIES:
            raise ValueError(f"ParallelDegrees.checkpointing must be one of {CHECKPOINT_POLICIES}, "
                             f"got {self.checkpointing!r}")
        if self.fsdp_reshard not in FSDP_RESHARD:
            raise ValueError(f"ParallelDegrees.fsdp_reshard must be one of {FSDP_RESHARD}, got {self.fsdp_reshard!r}")
        if self.ep % self.dp_shard and self.dp_shard % self.ep:
            raise ValueError(f"ParallelDegrees.ep ({self.ep}) must divide dp_shard ({self.dp_shard}) or be a multiple "
                             "of it")

    @property
    def plain(self) -> bool:
        """True without TP, sharding, EP or checkpointing (every rank holds its stages whole, DDP-style)."""
        return self.tp == 1 and self.dp_shard == 1 and self.ep == 1 and self.checkpointing == "none"


@dataclass(frozen=True)
class RankMemory(JsonDataclass):
    """Predicted bytes one rank holds for ``units`` (one stage, ``in_flight`` microbatches' activations).

    Attributes:
        parameters, gradients, optimizer: resident parameter, gradient and optimizer-state bytes (shards under FSDP2).
        activations: saved activations of ``in_flight`` microbatches.
        buffer: FSDP2's transient unsharded parameters and gradient (``shard_buffer_bytes``).
    """

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffer: float

    @property
    def state(self) -> float:
        """Parameters + gradients + optimizer state (bytes)."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        """Everything (bytes)."""
        return self.state + self.activations + self.buffer


@dataclass(frozen=True)
class GradAccumulation(JsonDataclass):
    """How a rank without pipeline stages accumulates gradients over a step: ``microbatches`` it runs per step and
    FSDP2's ``fsdp_reduce`` (``"step"``: the unsharded gradients accumulate; ``"microbatch"``: reduce-scattered
    after each).

    Raises:
        ValueError: on ``microbatches`` below 1 or an unknown ``fsdp_reduce`` (``FSDP_REDUCE``).
    """

    microbatches: int = 1
    fsdp_reduce: str = "step"

    def __post_init__(self) -> None:
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.fsdp_reduce not in FSDP_REDUCE:
            raise ValueError(f"fsdp_reduce must be one of {FSDP_REDUCE}, got {self.fsdp_reduce!r}")


_GIB = 2**30


@dataclass(frozen=True)
class HostSpec(JsonDataclass):
    """The host side of one device, for CPU offload.

    Attributes:
        memory_bytes: host memory per device (bytes); default 256 GiB: 2 TiB per 8-GPU node (a DGX H100 holds 2 TiB).
        h2d_Bps, d2h_Bps: host-to-device and device-to-host copy bandwidth per device (bytes/s, pinned memory);
            default 25e9: about half of PCIe Gen5 x16's 64 GB/s, as measured copies reach with 8 GPUs sharing the
            host's root complexes (uncertain).
        adamw_params_per_s: parameters the host's AdamW updates per second per device (the node's cores shared by
            its devices); default 2.5e8: a vectorized CPU AdamW does about 2e9 parameters/s on a 2-socket node
            (ZeRO-Offload's CPU-Adam, Ren et al. 2021, section 4.1), shared by 8 devices (uncertain).

    Raises:
        ValueError: on a field that is not a finite number > 0.
    """

    memory_bytes: float = 256 * _GIB
    h2d_Bps: float = 25e9
    d2h_Bps: float = 25e9
    adamw_params_per_s: float = 2.5e8

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"HostSpec.{f.name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class OffloadCost(JsonDataclass):
    """One device's memory and added time under CPU offload (module docstring).

    Attributes:
        device_static_bytes: frozen units' parameters kept whole on the device.
        activation_bytes: one microbatch's saved activations.
        buffer_bytes: FSDP2's unsharded working set (``sharding.shard_buffer_bytes``).
        host_bytes: the trainable shards with their gradients and optimizer state, in host memory.
        copy_s_per_microbatch: host-to-device copies (forward and backward) and the device-to-host gradient copy
            of one microbatch (seconds).
        adamw_s: the host's AdamW step over the shard (seconds, once per step).
        trainable_shard_params: trainable parameters in this device's shard.
    """

    device_static_bytes: float
    activation_bytes: float
    buffer_bytes: float
    host_bytes: float
    copy_s_per_microbatch: float
    adamw_s: float
    trainable_shard_params: float

    @property
    def device_bytes(self) -> float:
        """Peak device memory: static + activations + buffer (bytes)."""
        return self.device_static_bytes + self.activation_bytes + self.buffer_bytes

    def step_s(self, microbatches: int, grad_sync_s: float) -> float:
        """Seconds offload adds to a step of ``microbatches`` microbatches on this device whose gradient
        reduce-scatter takes ``grad_sync_s`` once: the copies of every microbatch, ``microbatches - 1`` more
        reduce-scatters and the host's AdamW."""
        return microbatches * self.copy_s_per_microbatch + max(0, microbatches - 1) * grad_sync_s + self.adamw_s


@dataclass(frozen=True)
class ActionOverheads(JsonDataclass):
    """Fixed host seconds a pipeline action costs beyond its units' work: the one definition of this term.
    The layout search's stage costs (``search_model.fill_stages``) and the timing of a plan
    (``search.evaluate_plan``) both add ``stage_s``; the per-message overheads are the ``P2PModel``'s.

    A stage action (``F``, or ``B`` when the stage runs a backward) pays ``per_action_s`` (the pipeline
    executor's bookkeeping) plus, for each module chunk of the stage (one per module it holds; ``B`` only for a
    chunk that runs a backward), that module's chunk overhead: ``modules[module]`` as ``(F, B)`` seconds, else
    ``(chunk_forward_s, chunk_backward_s)``. A one-rank plan runs no executor: ``per_action_s`` is not charged
    there (``stage_s(..., pipelined=False)``), its chunks are.

    After the flush every rank also steps its optimizer over its trainable parameters: ``update_s`` of their bytes
    (``optimizer_s_per_byte`` per byte; AdamW on a CPU core: about 5 ns per byte, 0.7 s for 33M float32
    parameters), charged by the search and ``evaluate_plan`` with the DP all-reduce (``search_model.flush_s``).

    Attributes:
        per_action_s: seconds per action of the pipeline runtime (``Profile.action_overhead_s``).
        chunk_forward_s, chunk_backward_s: seconds per module chunk and action, for modules not in ``modules``.
        modules: per module, ``(forward, backward)`` chunk seconds (``Profile.chunk_overhead_s``).
        optimizer_s_per_byte: seconds of the optimizer step per byte of a rank's trainable parameters.

    Raises:
        ValueError: on a negative value.
    """

    per_action_s: float = 0.0
    chunk_forward_s: float = 0.0
    chunk_backward_s: float = 0.0
    modules: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    optimizer_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        modules = {str(m): (float(v[0]), float(v[1])) for m, v in dict(self.modules).items()}
        object.__setattr__(self, "modules", modules)
        values = [self.per_action_s, self.chunk_forward_s, self.chunk_backward_s, self.optimizer_s_per_byte]
        values += [x for v in modules.values() for x in v]
        if any(not v >= 0 for v in values):
            raise ValueError(f"ActionOverheads must be >= 0, got {self}")

    @classmethod
    def of_device(cls, spec: DeviceSpec) -> "ActionOverheads":
        """The analytic overheads of a device preset: ``spec.chunk_overhead_s`` for every chunk and direction."""
        return cls(0.0, spec.chunk_overhead_s, spec.chunk_overhead_s)

    @property
    def zero(self) -> bool:
        """True when no action pays anything (a GPU preset): plans are timed as without overheads."""
        return not (self.per_action_s or self.chunk_forward_s or self.chunk_backward_s or self.optimizer_s_per_byte
                    or any(any(v) for v in self.modules.values()))

    def update_s(self, grad_bytes: float) -> float:
        """Seconds of one rank's optimizer step over ``grad_bytes`` bytes of trainable parameters."""
        return self.optimizer_s_per_byte * grad_bytes

    def chunk_s(self, module: str, kind: str) -> float:
        """Seconds one chunk of ``module`` costs per ``kind`` action (``"F"``, or ``"B"`` / ``"W"``: a backward
        action, input or weight gradients of a split backward, at the chunk's backward overhead).

        Raises:
            ValueError: on another kind.
        """
        if kind not in ("F", "B", "W"):
            raise ValueError(f"action kind must be 'F', 'B' or 'W', got {kind!r}")
        pair = self.modules.get(module, (self.chunk_forward_s, self.chunk_backward_s))
        return pair[0] if kind == "F" else pair[1]

    def stage_s(self, kind: str, chunks: Sequence[tuple[str, bool]], pipelined: bool = True) -> float:
        """Seconds a stage's ``kind`` action costs beyond its units (class docstring).

        Args:
            kind: ``"F"``, ``"B"`` or ``"W"``.
            chunks: the stage's module chunks as ``(module, runs the action)``: for ``B`` whether the chunk runs a
                backward, for ``W`` whether it trains (ignored for ``F``).
            pipelined: the plan runs on the pipeline executor (more than one rank): ``per_action_s`` is charged.

        Returns:
            0 for a ``B`` (``W``) of a stage none of whose chunks runs a backward (trains).
        """
        ran = [m for m, back in chunks if kind == "F" or back]
        if not ran:
            return 0.0
        return (self.per_action_s if pipelined else 0.0) + sum(self.chunk_s(m, kind) for m in ran)


def _canonical(value: Any) -> Any:
    """``value`` as plain JSON data (tuples -> lists, keys -> str), so equal keys compare equal after a round
    trip through a file."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


@dataclass(frozen=True)
class ProfileKey(JsonDataclass):
    """Everything a measured profile depends on; two profiles are interchangeable only when all fields agree.

    Attributes:
        model: the model description: the config dicts of the LLM and every encoder (HF config fields or
            paths), projector kinds, feature selection and the freezing flags, plus the attention settings.
        shapes: the microbatch shapes profiled (per microbatch: ``input_ids`` ``[B, N]`` and per modality
            the input tensor shapes).
        dtype: training dtype of the measurement (``"float32"``, ``"bfloat16"``).
        device: device name, with the CPU thread count (``"cpu x86_64 (1 threads)"``, ``"NVIDIA H200"``).
        plait_version, torch_version: package versions at measurement time.
        clock: how times were taken: ``"wall"`` (elapsed time, synchronised on GPUs) or ``"thread"`` (CPU
            time of the measuring thread: insensitive to other processes sharing the CPU, meaningful only
            with one intra-op thread).
    """

    model: Mapping[str, Any]
    shapes: Any
    dtype: str
    device: str
    plait_version: str
    torch_version: str
    clock: str = "wall"

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", _canonical(self.model))
        object.__setattr__(self, "shapes", _canonical(self.shapes))

    def digest(self) -> str:
        """A short stable hash of the whole key (16 hex digits), used in file names."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]
