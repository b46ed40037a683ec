"""Measure the cost of every pipeline unit of a real model on the real device.

For a list of microbatches (real samples, collated), :func:`measure_profile` measures per pipeline unit
(``plait.models.units.unit_specs``):

1. **Capture**: one forward of the whole model with every parameter made trainable, forward hooks on every
   module of every unit record each call's inputs (positional and keyword: hidden states, position
   embeddings, masks) and output. The LLM gets the positions it trains with: an M-RoPE LLM (Qwen2.5-VL's) the
   batch's ``rope_position_ids`` ``[3, B, N]``, any other ``position_ids`` ``[B, N]``. A module called several times per forward (an encoder run once per
   group of equally sized items) contributes every call.
2. **Isolation**: each captured call is re-run alone on detached inputs (the hidden-state input made a graph
   leaf when it was part of the graph): the forward (graph recorded, as in training), then
   ``torch.autograd.grad`` of the output w.r.t. the input only (dX), the parameters only (dW) and both at
   once (the fused backward an unsplit schedule runs). Each time is the median of ``repeats`` runs after
   ``warmup`` runs; a unit's time is the sum over its modules' calls, averaged over the microbatches.
   Inputs that are raw data (pixels, log-mel features, token ids) need no gradient: dX is 0 there. In a
   multi-module unit (Whisper's ``conv1, conv2, embed_positions``) only the first module's input is the
   unit's input; the input gradients of the later modules are on the way to the earlier weights and count
   as dW. The backward as zero-bubble schedules split it is timed too, with the runtime's own functions
   (``plait.parallel.pipeline.split_backward``): ``B`` = ``input_gradients`` (dX, keeping the gradients at the
   weights' intermediates) and ``W`` = ``weight_gradients`` from what ``B`` kept (a unit whose input needs no
   gradient has no split: its ``W`` is the dW backward from the output). A split ``W`` is a backward of its own,
   dearer than the fused backward's extra over dX; the simulator charges split schedules these times
   (``UnitMeasurement.split_input_grad_s`` / ``split_weight_grad_s``).
3. **Memory**: parameter bytes; gradient and AdamW-state bytes of the trainable parameters (the state is
   measured by one AdamW step on a copy); saved-activation bytes of one forward under the *real* freezing
   flags with ``torch.autograd.graph.saved_tensors_hooks`` (parameters excluded, each storage counted once
   per unit), attributed to the unit whose module is running; output bytes of the unit's last called module.
4. **Chunk overhead**: each module (every encoder branch, the LLM) is run as one pipeline stage by the
   runtime's stage code (``build_rank_stages`` on a copy of the model, payloads handed over as the runtime
   does, all forwards then all backwards); the measured ``F`` and ``B`` times minus the sum of the module's
   unit costs is the
   glue a stage chunk of that module pays once per action (rotary embeddings and mask construction of an
   LLM chunk, feature placement, the loss, the stage wrapper); a chunk whose input needs a gradient also runs
   the runtime's split backward, for its ``B_split`` and ``W_split`` glue (``plait.measure.chunk_timing``). The same stages are also run by the runtime's
   executor (``run_pipeline_step`` in this process): its time beyond the stage passes, per action, is the
   executor's own cost per action (``Profile.action_overhead_s``).
5. A MoE LLM's routing: one no-grad forward per microbatch counts each router's top-k expert ids
   (``Profile.router_load``; ``plait.measure.router_load``).

The result is a :class:`~plait.planner.cost.measured_profile.Profile` whose ``costs`` are the planner's
``UnitCost`` (so the partitioner, the layout search and the simulator take measured costs unchanged) and
whose ``chunk_overhead_s`` feeds ``plait.planner.cost.measured_profile.stage_action_costs``. Building a job's model and samples,
storing profiles and reusing them by key is the ``plait profile`` command's part (``plait.measure.job_profile``).
"""

from __future__ import annotations

import importlib.metadata
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.data.collate import Batch
from plait.data.progress import Progress
from plait.models.multimodal import MultimodalModel
from plait.models.units import UnitSpec, unit_specs
from plait.measure.chunk_timing import chunk_overhead, module_chunk_times
from plait.measure.router_load import measure_router_load
from plait.parallel.pipeline.split_backward import input_gradients, weight_gradients
from plait.train.loss import token_loss_sum
from plait.planner.cost.measured_profile import Profile, UnitMeasurement
from plait.planner.cost.types import ProfileKey

__all__ = ["CLOCKS", "KwargsFn", "LossFn", "PassTiming", "device_name", "measure_profile", "median_seconds",
           "microbatch_shapes", "profile_key", "unit_pass_timings"]

CLOCKS = ("wall", "thread")
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KwargsFn = Callable[[Batch], Mapping[str, Any]]


# ----- keys ------------------------------------------------------------------------------------------------
def device_name(device: torch.device | str) -> str:
    """The device part of a profile key: the GPU's name, or ``"cpu <machine> (<n> threads)"`` (CPU timings
    depend on the intra-op thread count)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.machine()} ({torch.get_num_threads()} threads)"


def _tensor_shapes(value: Any) -> Any:
    """Shapes of the tensors in a nested input structure (lists/dicts kept, other values by type name)."""
    if isinstance(value, torch.Tensor):
        return [*value.shape]
    if isinstance(value, Mapping):
        return {str(k): _tensor_shapes(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tensor_shapes(v) for v in value]
    return type(value).__name__


def microbatch_shapes(microbatches: Sequence[Batch]) -> list[dict[str, Any]]:
    """The shapes part of a profile key: per microbatch, ``input_ids`` ``[B, N]``, the number of target
    tokens and, per modality, the shapes of its input tensors."""
    return [{"input_ids": [*b.input_ids.shape], "target_tokens": int(b.target_tokens),
             "modalities": _tensor_shapes(dict(b.modality_inputs))} for b in microbatches]


def profile_key(model_description: Mapping[str, Any], microbatches: Sequence[Batch], dtype: torch.dtype | str,
                device: torch.device | str, clock: str = "wall") -> ProfileKey:
    """The :class:`ProfileKey` of a measurement: ``model_description`` (config dicts and freezing flags),
    the microbatches' shapes, ``dtype``, :func:`device_name`, the installed plait and torch versions and the
    ``clock`` (``"wall"`` or ``"thread"``, see :func:`measure_profile`).

    Raises:
        ValueError: on an unknown clock.
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    try:
        plait_version = importlib.metadata.version("plait")
    except importlib.metadata.PackageNotFoundError:
        plait_version = "unknown"
    return ProfileKey(dict(model_description), microbatch_shapes(microbatches), str(dtype).removeprefix("torch."),
                      device_name(device), plait_version, torch.__version__, clock)


# ----- timing helpers ------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class _Timer:
    """How to time: device to synchronise, clock, repetitions. A timer that also measures energy (the GPU sweep
    of ``plait.measure.energy_sweep``) sets ``last_joules`` to the joules per run of its last :meth:`median`."""

    device: torch.device
    clock: str
    repeats: int
    warmup: int
    last_joules = 0.0

    def now(self) -> float:
        _sync(self.device)
        return time.thread_time() if self.clock == "thread" else time.perf_counter()

    def median(self, fn: Callable[[Any], Any], setup: Callable[[], Any]) -> float:
        """Median seconds of ``fn(setup())`` over ``repeats`` runs after ``warmup`` runs (``setup`` untimed)."""
        return median_seconds(fn, setup, self.now, self.repeats, self.warmup)


def median_seconds(fn: Callable[[Any], Any], setup: Callable[[], Any], now: Callable[[], float], repeats: int,
                   warmup: int) -> float:
    """The one timing loop of the profilers: median seconds (by the clock ``now``) of ``fn(setup())`` over
    ``repeats`` runs after ``warmup`` discarded ones, ``setup`` untimed; 0.0 when ``repeats`` is 0."""
    times = []
    for i in range(warmup + repeats):
        state = setup()
        start = now()
        fn(state)
        if i >= warmup:
            times.append(now() - start)
    return statistics.median(times) if times else 0.0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The main output tensor of a module call (a tensor, the first tensor of a tuple/list/ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


# ----- capture -------------------------------------------------------------------------------------------
@dataclass
class _Call:
    """One call of a unit's module during the capture forward."""

    module: nn.Module
    args: tuple
    kwargs: dict
    output_bytes: int = 0


def _unit_modules(model: nn.Module, specs: Sequence[UnitSpec]) -> list[list[tuple[str, nn.Module]]]:
    return [[(path, model.get_submodule(path)) for path in spec.modules] for spec in specs]


@contextmanager
def _capture_calls(modules: list[list[tuple[str, nn.Module]]]) -> Iterator[list[list[_Call]]]:
    """Per unit, the calls of its modules in call order, recorded by hooks for the duration of the block."""
    calls: list[list[_Call]] = [[] for _ in modules]
    handles = []
    for index, unit_modules in enumerate(modules):
        for _, module in unit_modules:
            pending: list[_Call] = []

            def pre(mod: nn.Module, args: tuple, kwargs: dict, index: int = index, pending: list = pending) -> None:
                call = _Call(mod, args, dict(kwargs))
                pending.append(call)
                calls[index].append(call)

            def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any, pending: list = pending) -> None:
                tensor = _first_tensor(out)
                pending.pop().output_bytes = _nbytes(tensor) if tensor is not None else 0

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _prepare(call: _Call) -> tuple[tuple, dict, torch.Tensor | None]:
    """Detached copies of a call's inputs; the hidden-state input (first positional tensor, else
    ``hidden_states``) becomes a graph leaf when it was part of the graph (then dX applies)."""
    args, kwargs = list(_detached(call.args)), _detached(call.kwargs)
    leaf = None
    if args and isinstance(call.args[0], torch.Tensor):
        if call.args[0].requires_grad and call.args[0].is_floating_point():
            leaf = args[0] = args[0].requires_grad_(True)
    elif isinstance(call.kwargs.get("hidden_states"), torch.Tensor) and call.kwargs["hidden_states"].requires_grad:
        leaf = kwargs["hidden_states"] = kwargs["hidden_states"].requires_grad_(True)
    return tuple(args), kwargs, leaf


@dataclass
class PassTiming:
    """Seconds of a unit's (or one call's) passes for one microbatch: forward, dX, dW and the fused backward;
    ``split_b`` / ``split_w``: the runtime's split backward, ``B`` (input gradients) and ``W`` (weight gradients
    from what ``B`` kept; module docstring, step 2); the ``*_j`` fields are their joules when the timer measures
    energy (0 otherwise); the output's bytes."""

    forward: float = 0.0
    dx: float = 0.0
    dw: float = 0.0
    fused: float = 0.0
    split_b: float = 0.0
    split_w: float = 0.0
    output_bytes: int = 0
    forward_j: float = 0.0
    dx_j: float = 0.0
    dw_j: float = 0.0
    fused_j: float = 0.0

    def get(self, field: str) -> float:
        """The value of ``field`` (``"forward"``, ``"dx_j"``, ...)."""
        return getattr(self, field)


def _time_call(call: _Call, timer: _Timer, autocast: Callable[[], AbstractContextManager],
               split: bool = True) -> PassTiming:
    """Forward, dX, dW and fused-backward medians of one call re-run in isolation; with ``split`` also the
    runtime's split ``B`` and ``W``."""
    params = [p for p in call.module.parameters() if p.requires_grad]

    def forward(state: tuple) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        args, kwargs, leaf = state
        with autocast():
            return _first_tensor(call.module(*args, **kwargs)), leaf

    probe, _ = forward(_prepare(call))
    if probe is None:
        return PassTiming()
    grad_out = torch.randn(probe.shape, generator=torch.Generator().manual_seed(0)).to(probe)
    timing = PassTiming(output_bytes=call.output_bytes)
    timing.forward = timer.median(forward, lambda: _prepare(call))
    timing.forward_j = timer.last_joules

    def backward(targets: Callable[[torch.Tensor | None], list[torch.Tensor]]) -> tuple[float, float]:
        def setup() -> tuple:
            out, leaf = forward(_prepare(call))
            return out, targets(leaf)

        def run(state: tuple) -> None:
            out, inputs = state
            with autocast():
                torch.autograd.grad([out], inputs, [grad_out], allow_unused=True)

        return timer.median(run, setup), timer.last_joules

    if not probe.requires_grad:
        return timing
    has_leaf = _prepare(call)[2] is not None
    if has_leaf:
        timing.dx, timing.dx_j = backward(lambda leaf: [leaf])
    if params:
        timing.dw, timing.dw_j = backward(lambda leaf: list(params))
    if has_leaf or params:
        timing.fused, timing.fused_j = backward(lambda leaf: ([leaf] if leaf is not None else []) + list(params))
    if not split:
        return timing
    if has_leaf:
        timing.split_b, timing.split_w = _time_split(forward, lambda: _prepare(call), grad_out, params, timer,
                                                     autocast)
    else:  # raw-data input: B has nothing to do, W is the backward from the output to the weights (dW)
        timing.split_w = timing.dw
    return timing


def _time_split(forward: Callable[[tuple], tuple], prepare: Callable[[], tuple], grad_out: torch.Tensor,
                params: Sequence[torch.Tensor], timer: _Timer,
                autocast: Callable[[], AbstractContextManager]) -> tuple[float, float]:
    """Median seconds of the runtime's split backward of one call with a graph input, over ``timer.repeats`` runs
    after ``timer.warmup``, each on a fresh forward (untimed): ``B`` = ``input_gradients`` of the input (keeping
    the gradients at the weights' intermediates), then ``W`` = ``weight_gradients`` from what ``B`` kept,
    accumulated into ``.grad`` as the runtime does (cleared untimed)."""
    b_times, w_times = [], []
    for i in range(timer.warmup + timer.repeats):
        for p in params:
            p.grad = None
        out, leaf = forward(prepare())
        start = timer.now()
        with autocast():
            kept = input_gradients([(out, grad_out)], [leaf], params)[1]
        middle = timer.now()
        with autocast():
            weight_gradients(kept)
        end = timer.now()
        if i >= timer.warmup:
            b_times.append(middle - start)
            w_times.append(end - middle)
    for p in params:
        p.grad = None
    return statistics.median(b_times), statistics.median(w_times)


@contextmanager
def _all_trainable(model: nn.Module) -> Iterator[None]:
    """Every parameter requires a gradient for the block (so every unit has a graph to time); the flags and
    the train/eval mode are restored afterwards."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    mode = model.training
    try:
        for p, _ in flags:
            p.requires_grad_(True)
        model.train()
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(mode)


def _forward_loss(model: MultimodalModel, batch: Batch, llm_kwargs: KwargsFn, loss_fn: LossFn) -> torch.Tensor:
    """The loss of one whole-model forward as training runs it: an M-RoPE LLM rotates with the batch's
    ``rope_position_ids`` ``[3, B, N]`` (:meth:`MultimodalModel.llm_positions`), any other with ``position_ids``."""
    logits = model(batch.input_ids, batch.modality_inputs, batch.attention_mask, batch.position_ids,
                   rope_position_ids=batch.rope_position_ids, use_cache=False, **llm_kwargs(batch))
    return loss_fn(logits, batch.labels)


def unit_pass_timings(model: MultimodalModel, specs: Sequence[UnitSpec], batch: Batch, timer: _Timer,
                      llm_kwargs: KwargsFn, autocast: Callable[[], AbstractContextManager],
                      bar: Any = None, split: bool = True) -> list[PassTiming]:
    """Per unit (``specs`` order), the summed isolated timings (and joules, when ``timer`` measures them) of its
    calls for one microbatch ``batch``, with every parameter trainable (module docstring, steps 1-2). In a
    multi-module unit only the first module's dX is the unit's; the later modules' dX count as dW. ``bar``: a
    progress (:class:`~plait.data.progress.Progress`) advanced by one per unit; ``split``: also time the runtime's
    split backward (``PassTiming.split_b`` / ``split_w``; summed over every module of a unit, since the runtime's
    ``B`` runs through all of them)."""
    modules = _unit_modules(model, specs)
    with _all_trainable(model):
        with _capture_calls(modules) as calls, autocast():
            _forward_loss(model, batch, llm_kwargs, token_loss_sum)
        out = []
        for unit_modules, unit_calls in zip(modules, calls):
            total = PassTiming()
            first = unit_modules[0][1]
            for call in unit_calls:
                t = _time_call(call, timer, autocast, split)
                for q in ("", "_j"):
                    _add(total, "forward" + q, t.get("forward" + q))
                    _add(total, "fused" + q, t.get("fused" + q))
                    if call.module is first:
                        _add(total, "dx" + q, t.get("dx" + q))
                        _add(total, "dw" + q, t.get("dw" + q))
                    else:  # inside a multi-module unit the gradient reaching earlier weights passes this input
                        _add(total, "dw" + q, t.get("dw" + q) + t.get("dx" + q))
                _add(total, "split_b", t.split_b)  # the runtime's B runs through every module to the unit's input
                _add(total, "split_w", t.split_w)
            last = unit_calls[-1].module if unit_calls else None
            total.output_bytes = sum(c.output_bytes for c in unit_calls if c.module is last)
            out.append(total)
            if bar is not None:
                bar.update(1)
    return out


def _add(total: PassTiming, field: str, value: float) -> None:
    setattr(total, field, getattr(total, field) + value)


# ----- memory --------------------------------------------------------------------------------------------
def _saved_bytes(model: MultimodalModel, specs: Sequence[UnitSpec], batch: Batch, llm_kwargs: KwargsFn,
                 autocast: Callable[[], AbstractContextManager]) -> list[int]:
    """Per unit, bytes saved for backward by one forward under the model's real flags (module docstring)."""
    params = {p.data_ptr() for p in model.parameters()}
    current: list[int] = []
    storages: list[dict[int, int]] = [{} for _ in specs]
    handles = []
    for index, (_, unit_modules) in enumerate(zip(specs, _unit_modules(model, specs))):
        for _, module in unit_modules:
            handles.append(module.register_forward_pre_hook(lambda m, a, i=index: current.append(i)))
            handles.append(module.register_forward_hook(lambda m, a, o: None if current.pop() is None else None))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current and t.data_ptr() not in params:
            storage = t.untyped_storage()
            storages[current[-1]][storage.data_ptr()] = storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
            _forward_loss(model, batch, llm_kwargs, token_loss_sum)
    finally:
        for handle in handles:
            handle.remove()
    return [sum(s.values()) for s in storages]


def _adamw_state_bytes(params: Sequence[nn.Parameter]) -> int:
    """Bytes of AdamW's state for ``params``, measured by one step on detached copies (zero gradients)."""
    if not params:
        return 0
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    for c in copies:
        c.grad = torch.zeros_like(c)
    opt = torch.optim.AdamW(copies, lr=0.0)
    opt.step()
    return sum(_nbytes(v) for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def _unit_bytes(model: MultimodalModel, spec: UnitSpec, held: set[int]) -> tuple[int, int, int]:
    """``(parameter, gradient, optimizer-state)`` bytes of a unit under the real flags; a parameter in ``held`` (ids
    of the earlier units' parameters: a tied LLM head's weight is the embedding's) is not counted again. Adds the
    unit's parameters to ``held``."""
    params = [p for p in {id(p): p for m in spec.modules for p in model.get_submodule(m).parameters()}.values()
              if id(p) not in held]
    held.update(id(p) for p in params)
    trainable = [p for p in params if p.requires_grad]
    return (sum(_nbytes(p) for p in params), sum(_nbytes(p) for p in trainable), _adamw_state_bytes(trainable))


# ----- the profile ---------------------------------------------------------------------------------------
def measure_profile(
    model: MultimodalModel,
    microbatches: Sequence[Batch],
    key: ProfileKey,
    *,
    repeats: int = 5,
    warmup: int = 2,
    llm_kwargs: KwargsFn | None = None,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    progress: bool = False,
) -> Profile:
    """Measure every unit of ``model`` on ``microbatches`` (module docstring for the method), timed with
    ``key.clock``: ``"wall"`` (``time.perf_counter``, CUDA synchronised) or ``"thread"`` (``time.thread_time``,
    the measuring thread's CPU time: robust when other processes share the CPU, valid with one intra-op
    thread only).

    Args:
        model: the composite with its real freezing flags, on the device to profile (left unchanged: flags
            and mode are restored, the chunk measurement runs on a copy).
        microbatches: collated microbatches on that device (``input_ids`` ``[B, N]`` each); costs are their
            mean.
        key: the profile's key (:func:`profile_key`).
        repeats, warmup: timed and discarded runs per measurement (median of the timed ones).
        llm_kwargs: extra LLM keyword arguments per microbatch (attention metadata), as the trainer passes.
        autocast: context factory around every forward/backward (e.g. bf16 autocast).
        progress: show progress on stderr (a bar on a terminal) (units timed, then the module chunks).

    Returns:
        The :class:`Profile` (times in seconds, memory in bytes).

    Raises:
        ValueError: on no microbatch, ``repeats`` < 1 or ``warmup`` < 0, or a model family without a
            pipeline layout.
    """
    if not microbatches:
        raise ValueError("measure_profile needs at least one microbatch")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    llm_kwargs = llm_kwargs or (lambda batch: {})
    device, clock = microbatches[0].input_ids.device, key.clock
    if clock == "thread" and (device.type != "cpu" or torch.get_num_threads() != 1):
        raise ValueError("clock='thread' times CPU work of one thread: use it on CPU with torch.set_num_threads(1)")
    specs = unit_specs(model)
    timer = _Timer(device, clock, repeats, warmup)
    bar = Progress(len(specs) * len(microbatches), "profiling units", "unit", progress)
    per_mb = [unit_pass_timings(model, specs, b, timer, llm_kwargs, autocast, bar) for b in microbatches]
    saved = [_saved_bytes(model, specs, b, llm_kwargs, autocast) for b in microbatches]
    n = len(microbatches)
    measurements = []
    held: set[int] = set()
    for i, spec in enumerate(specs):
        param, grad, state = _unit_bytes(model, spec, held)
        mean = lambda attr: sum(getattr(t[i], attr) for t in per_mb) / n  # noqa: E731
        measurements.append(UnitMeasurement(
            spec.unit.name, mean("forward"), mean("dx"), mean("dw"), mean("fused"), param, grad, state,
            round(sum(s[i] for s in saved) / n), round(mean("output_bytes")), mean("split_b"), mean("split_w")))
    units = tuple(s.unit for s in specs)
    costs = [m.to_cost(u) for u, m in zip(units, measurements)]
    bar.describe("profiling module chunks and runtime overheads")
    chunks, per_action = module_chunk_times(model, microbatches, llm_kwargs, autocast, timer)
    bar.close()
    def forward(batch: Batch) -> None:  # the routers' counts (Profile.router_load)
        with autocast():
            _forward_loss(model, batch, llm_kwargs, lambda logits, labels: logits)

    routed = measure_router_load(model, specs, microbatches, forward)
    overhead = chunk_overhead(chunks, units, costs)
    return Profile(key, units, tuple(measurements), overhead, repeats, warmup, per_action, routed)
