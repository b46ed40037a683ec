"""Tensor parallelism (TP): the attention heads and MLPs of every layer split over the ``tp`` ranks, with PyTorch's
DTensor styles (``torch.distributed.tensor.parallel.parallelize_module``, ``ColwiseParallel``/``RowwiseParallel``).

Plans (module path -> transformers' style name) come from the model, never from plait for an LLM family:

- the causal LM: the plan transformers ships with its family (``base_model_tp_plan`` + the class's ``_tp_plan``,
  :func:`plait.models.hf.llm_tp_plan`): q/k/v, gate/up colwise, o/down rowwise, the input embedding
  vocabulary-sharded (``embedding_rowwise``) and the head colwise with a gathered output;
- each encoder: the small per-family plans beside the layouts (:func:`plait.models.hf.encoder_tp_plan`);
- each projector: the encoder's output is replicated, so an MLP projector is split colwise/rowwise (its output
  replicated again), a linear projector stays replicated.

The style names are translated to PyTorch's styles (:data:`STYLES`; a name outside it is refused, naming the
module). Between the sharded modules every activation is a plain, replicated tensor (``use_local_output``), so
plait's attention (multimodal masks, context parallelism) sees this rank's heads only, pipeline stages exchange
ordinary tensors, and replicated parameters (norms, embeddings of encoders) get the same full gradient on every TP
rank (each colwise input's gradient is all-reduced in its backward: Megatron-LM's f/g operators).

LoRA (``peft``): an adapted module keeps its style on ``base_layer``; its adapters are split consistently, for a
colwise base ``lora_B`` colwise (``lora_A`` replicated), for a rowwise base ``lora_A`` rowwise (``lora_B``
replicated), so the adapter's output has the base's layout. Tied input/output embeddings stay replicated.

Gradient clipping with DTensor gradients: :func:`clip_grad_norm_` computes the true global norm from the local
shards (:func:`grad_square_sum`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from plait.models.hf import TP_STYLES, encoder_tp_plan, llm_layout, llm_tp_plan
from plait.models.multimodal import MultimodalModel
from plait.parallel.data_parallel import sum_gradients
from plait.parallel.dims import ParallelDims

__all__ = [
    "PROJECTOR_TP_PLAN",
    "STYLES",
    "RankTensorParallel",
    "align_gradients",
    "apply_job_tensor_parallel",
    "apply_tensor_parallel",
    "branch_tp_plan",
    "check_max_norm",
    "check_tp_heads",
    "clip_by_square_sum_",
    "clip_grad_norm_",
    "concrete_plan",
    "grad_square_sum",
    "local_tensor",
    "model_tp_plan",
    "sum_local_gradients",
]

_COLWISE = ("colwise", "colwise_gather_output", "colwise_rep")
_ROWWISE = ("rowwise", "rowwise_rep", "rowwise_split_input")
STYLES = TP_STYLES
"""transformers' style names plait applies (``plait.models.hf.TP_STYLES``, which the planner reads through
``tp_refusal``; the others: packed, MoE, MLA, sequence parallel, are refused)."""

PROJECTOR_TP_PLAN = {"linear_1": "colwise", "linear_2": "rowwise"}
"""Plan of an ``mlp`` projector (Linear -> GELU -> Linear): replicated features in, replicated features out."""

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads")
_HEAD_PROJ = ("q_proj", "k_proj", "v_proj")


def _torch_style(name: str, where: str) -> ParallelStyle | None:
    """PyTorch's style for transformers' style ``name`` (None: replicated). ``where`` names the module in errors."""
    if name == "colwise":
        return ColwiseParallel()
    if name in ("colwise_gather_output", "colwise_rep"):
        return ColwiseParallel(output_layouts=Replicate())
    if name == "rowwise":
        return RowwiseParallel()
    if name in ("rowwise_rep", "rowwise_split_input", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=Replicate())
    if name == "replicate":
        return None
    raise ValueError(f"tensor parallelism: {where} has style {name!r}, which plait does not apply "
                     f"(supported: {', '.join(STYLES)})")


def model_tp_plan(model: MultimodalModel) -> dict[str, str]:
    """The plan of the whole composite: module path (relative to ``model``, ``*`` for a layer index) -> style
    name. The LLM's is transformers' (:func:`~plait.models.hf.llm_tp_plan`) without its embedding and head
    entries when they are tied; each encoder's from :func:`~plait.models.hf.encoder_tp_plan`; an MLP projector's
    :data:`PROJECTOR_TP_PLAN`.

    Raises:
        ValueError: when the LLM family ships no plan or an encoder family has none.
    """
    llm = model.language_model
    plan = {f"language_model.{k}": v for k, v in llm_tp_plan(llm).items()}
    layout = llm_layout(llm)  # embeddings by name: a pipeline rank may hold one of them, the other pruned
    weight = getattr(llm.get_input_embeddings(), "weight", None)
    tied = getattr(llm.config.get_text_config(), "tie_word_embeddings", False) or (
        weight is not None and weight is getattr(llm.get_output_embeddings(), "weight", None))
    if tied:  # one parameter, possibly on two pipeline ranks: replicated, like the rest of the embedding unit
        for path in (layout.embed, layout.head):
            plan.pop(f"language_model.{path}", None)
    for name in model.encoders:
        plan.update(branch_tp_plan(model, name))
    return plan


def branch_tp_plan(model: MultimodalModel, name: str) -> dict[str, str]:
    """The plan of encoder branch ``name`` of the composite (paths relative to ``model``): its tower's
    (:func:`~plait.models.hf.encoder_tp_plan`) and, for an MLP projector, :data:`PROJECTOR_TP_PLAN`.

    Raises:
        ValueError: when the tower's family has no TP plan.
    """
    branch = model.encoders[name]
    plan = {f"encoders.{name}.encoder.{k}": v for k, v in encoder_tp_plan(branch.encoder).items()}
    if getattr(branch.projector, "kind", None) == "mlp":  # pruned (nn.Identity) on other pipeline ranks
        plan.update({f"encoders.{name}.projector.{k}": v for k, v in PROJECTOR_TP_PLAN.items()})
    return plan


def _is_lora(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)


def _lora_entries(path: str, module: nn.Module, style: str) -> dict[str, str]:
    """A LoRA-wrapped module's entries: the style on ``base_layer``, the adapters split to match (module
    docstring). Raises ValueError for an adapted embedding."""
    if style in _COLWISE:
        side = "lora_B"
    elif style in _ROWWISE:
        side = "lora_A"
    else:
        raise ValueError(f"tensor parallelism: LoRA adapters on {path} (style {style!r}) cannot be split "
                         "consistently with their base layer; leave that module out of lora.target_modules")
    out = {f"{path}.base_layer": style}
    out.update({f"{path}.{side}.{adapter}": style for adapter in getattr(module, side)})
    return out


def concrete_plan(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """``plan``'s patterns (``*``: one name component) matched against the modules ``model`` holds: entries of
    pruned or absent modules (another pipeline rank's units, an ``nn.Identity``) are left out; a ``peft`` LoRA
    module becomes its base layer and adapters (:func:`_lora_entries`); ``"replicate"`` entries are dropped.

    Raises:
        ValueError: on a style outside :data:`STYLES` or an adapted module that cannot be split.
    """
    patterns = [(re.compile(re.escape(k).replace(r"\*", r"[^.]+") + r"\Z"), k, v) for k, v in plan.items()]
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        for pattern, key, style in patterns:
            if not pattern.match(name):
                continue
            _torch_style(style, name)  # refuse unknown styles early, naming the module
            if style == "replicate":
                continue
            if _is_lora(module):
                out.update(_lora_entries(name, module, style))
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                out[name] = style
    return out


def _check_divisible(model: nn.Module, plan: Mapping[str, str], tp: int, field: str = "parallel.tp") -> None:
    """Refuse a degree that does not divide the heads of an attention module the plan splits."""
    for name, style in plan.items():
        short = name.rsplit(".", 1)[-1]
        if short == "base_layer":
            name = name.rsplit(".", 1)[0]
            short = name.rsplit(".", 1)[-1]
        if style not in _COLWISE or short not in _HEAD_PROJ:
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        head_dim = getattr(parent, "head_dim", None)
        layer = model.get_submodule(name)
        width = (layer.base_layer if _is_lora(layer) else layer).out_features
        if isinstance(head_dim, int) and width % (head_dim * tp):
            raise ValueError(f"{field}={tp} does not divide the {width // head_dim} heads of {name} "
                             f"(each TP rank needs whole heads)")


def _divide_heads(model: nn.Module, plan: Mapping[str, str], tp: int) -> None:
    """Attention modules whose q/k/v are split now hold ``1/tp`` of the heads: divide their head counts (Whisper
    reshapes keys by ``num_heads``; the others by ``-1``)."""
    parents = set()
    for name, style in plan.items():
        parts = name.split(".")
        if parts[-1] == "base_layer":
            parts = parts[:-1]
        if style in _COLWISE and parts[-1] in _HEAD_PROJ:
            parents.add(".".join(parts[:-1]))
    for path in parents:
        attention = model.get_submodule(path)
        for attr in _HEAD_ATTRS:
            value = getattr(attention, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(attention, attr, value // tp)


def _scoped_plan(model: MultimodalModel, branch: str | None) -> tuple[dict[str, str], str]:
    """The concrete plan a TP degree splits (the whole model's, or encoder ``branch``'s alone) and the config field
    that degree comes from (``parallel.tp``, or ``parallel.pp.encoder_tp.<branch>``)."""
    if branch is None:
        return concrete_plan(model, model_tp_plan(model)), "parallel.tp"
    return concrete_plan(model, branch_tp_plan(model, branch)), f"parallel.pp.encoder_tp.{branch}"


def check_tp_heads(model: MultimodalModel, tp: int, branch: str | None = None) -> None:
    """Refuse a TP degree ``model`` cannot be split by, before any process is launched (the check
    :func:`apply_tensor_parallel` runs; ``model`` may be on the meta device). ``branch``: check only that encoder
    branch's plan (:func:`branch_tp_plan`, its own degree ``parallel.pp.encoder_tp``).

    Raises:
        ValueError: when a family of the model (of the branch) has no TP plan, or ``tp`` does not divide the heads
            of a split attention module (naming it, and ``parallel.pp.encoder_tp.<branch>`` for a branch).
    """
    plan, field = _scoped_plan(model, branch)
    _check_divisible(model, plan, tp, field)


def apply_tensor_parallel(model: MultimodalModel, mesh: Any, branch: str | None = None) -> dict[str, str]:
    """Split ``model``'s modules over the 1-D TP DeviceMesh ``mesh`` in place (:func:`model_tp_plan`, or with
    ``branch`` only that encoder branch's :func:`branch_tp_plan`, matched to the modules this rank holds). Call
    after the weights are materialised, identical on every TP rank (the same seed or checkpoint): each rank keeps
    its slice, nothing is communicated. Frozen parameters stay frozen. Returns the applied plan (concrete module
    name -> style name).

    Raises:
        ValueError: when the mesh is not 1-D, a family has no plan, the degree does not divide the heads of a split
            attention module, or a style / adapted module cannot be applied.
    """
    if mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs the 1-D TP mesh, got a {mesh.ndim}-D mesh")
    tp = mesh.size()
    plan, field = _scoped_plan(model, branch)
    _check_divisible(model, plan, tp, field)
    styles = {name: _torch_style(style, name) for name, style in plan.items()}
    parallelize_module(model, mesh, styles, src_data_rank=None)
    _divide_heads(model, plan, tp)
    return plan


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t``: the local shard of a DTensor (sharing its storage), ``t`` itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_count(t: torch.Tensor) -> int:
    """Ranks among which ``t``'s elements are split (1 for a plain or replicated tensor)."""
    if not isinstance(t, DTensor):
        return 1
    # FSDP2 over TP-split parameters gives _StridedShard placements, which are not is_shard() in torch 2.13
    return math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements)
                     if not (p.is_replicate() or p.is_partial()))


def grad_square_sum(grads: Iterable[torch.Tensor], copies: int) -> torch.Tensor:
    """This rank's share of the squared L2 norm of ``grads`` (float64 scalar): the sum over the ranks holding
    them (``copies`` ranks, each with the whole of a plain or replicated gradient or one shard of a DTensor
    gradient) is the true squared norm. A DTensor's local shard counts ``shards / copies`` times, a plain
    gradient ``1 / copies`` times; every copy must hold its final (already reduced) gradient, a DTensor one in
    shard or replicate placements (:func:`align_gradients`).

    Raises:
        ValueError: when ``copies`` < 1 or a gradient is partial.
    """
    if copies < 1:
        raise ValueError(f"grad_square_sum: copies must be >= 1, got {copies}")
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
            raise ValueError("grad_square_sum: a partial DTensor gradient (reduce it first: align_gradients)")
        local = local_tensor(g).detach()
        total += local.double().pow(2).sum().cpu() * (_shard_count(g) / copies)
    return total


def clip_grad_norm_(params: Sequence[nn.Parameter], max_norm: float, copies: int = 1, group: Any = None,
                    device: torch.device | str = "cpu") -> float:
    """Clip the gradients of ``params`` to a global L2 norm of ``max_norm`` in place (``torch.nn.utils``'s rule:
    scale by ``min(1, max_norm / (norm + 1e-6))``) and return the norm before clipping, for plain and DTensor
    gradients alike. With ``copies`` > 1 the squared norm (:func:`grad_square_sum`) is summed over ``group``
    (default: all ranks; every rank holding a piece of ``params`` must be in it, and call this). ``device``: where
    the all-reduced scalar lives (the backend's device).

    Raises:
        ValueError: on a negative ``max_norm``.
    """
    check_max_norm(max_norm)
    align_gradients(params)
    grads = [p.grad for p in params if p.grad is not None]
    return clip_by_square_sum_(grads, grad_square_sum(grads, copies).to(device), max_norm, reduce=copies > 1,
                               group=group)


def check_max_norm(max_norm: float) -> None:
    """A clipping norm must be >= 0 (``float("inf")``: no clipping).

    Raises:
        ValueError: on a negative ``max_norm``.
    """
    if max_norm < 0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")


def clip_by_square_sum_(grads: Iterable[torch.Tensor], sumsq: torch.Tensor, max_norm: float, *, reduce: bool,
                        group: Any = None) -> float:
    """The end of every gradient clipping: the global L2 norm from ``sumsq`` (this rank's share of the squared
    norm, float64 scalar, :func:`grad_square_sum`; summed over ``group`` first when ``reduce``: collective, default
    group all ranks), then ``grads`` (their local tensors) scaled in place by ``max_norm / (norm + 1e-6)`` when
    that is below 1 (``torch.nn.utils.clip_grad_norm_``'s rule). Returns the norm before clipping."""
    if reduce:
        dist.all_reduce(sumsq, group=group)
    norm = float(sumsq.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            local_tensor(g).mul_(coef)
    return norm


def align_gradients(params: Iterable[nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements (e.g. a vocabulary-sharded embedding's gradient may
    come back replicated or partial): a partial one is reduced, a replicated one sliced. Collective over the TP
    mesh when a gradient needs a reduction; every TP rank calls it with the same parameters."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


def sum_local_gradients(params: Sequence[nn.Parameter], group: Any = None) -> None:
    """:func:`plait.parallel.data_parallel.sum_gradients` over ``group`` for parameters that may be DTensors: each
    DTensor gradient's local shard is summed in place (every rank of ``group`` holds the same shard of it: the
    group spans one TP rank's data-parallel / CP peers); a DTensor parameter without a gradient on this rank but
    with one elsewhere gets the sum as a DTensor of its own placements. Collective over ``group``."""
    align_gradients(params)
    proxies = []
    for p in params:
        if not isinstance(p, DTensor):
            proxies.append(p)
            continue
        proxy = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
        proxy.grad = None if p.grad is None else p.grad.to_local()
        proxies.append(proxy)
    sum_gradients(proxies, group)
    for p, proxy in zip(params, proxies):
        if isinstance(p, DTensor) and p.grad is None and proxy.grad is not None:
            p.grad = DTensor.from_local(proxy.grad, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())


@dataclass(frozen=True)
class RankTensorParallel:
    """This rank's tensor parallelism in a trainer: the applied plan, the group its gradients are summed over (the
    trainer calls :func:`sum_local_gradients` with :attr:`grad_group`) and the clipping of its gradients.

    Attributes:
        plan: applied plan (concrete module name -> style name), :func:`apply_tensor_parallel`.
        degree: TP degree.
        grad_group: the process group of this TP rank's data-parallel and CP peers (same ``tp`` and ``pp``
            coordinates: the ranks whose gradients of the same shards are summed without FSDP2).
        copies: ranks holding a piece of each parameter of this rank's stages (``world / pp``), for clipping.
    """

    plan: dict[str, str]
    degree: int
    grad_group: Any
    copies: int

    def clip_grad_norm_(self, params: Sequence[nn.Parameter], max_norm: float,
                        device: torch.device | str = "cpu") -> float:
        """:func:`clip_grad_norm_` over every rank (the true global norm; ``max_norm`` <= 0: no clipping, the norm
        is still returned). Collective over all ranks."""
        return clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), self.copies, None, device)


def apply_job_tensor_parallel(model: MultimodalModel, dims: ParallelDims, mesh: Any, rank: int,
                              device_type: str = "cpu") -> RankTensorParallel | None:
    """Tensor parallelism for a trainer: None when ``dims.tp`` is 1; otherwise ``model`` (whole, or a pipeline
    rank's pruned composite: only its own units are split) is split over ``mesh["tp"]`` (``mesh``: the job's
    named DeviceMesh over :data:`plait.parallel.dims.AXES`; None: built here on ``device_type``) and the gradient
    group of this TP rank is made.
    Collective (every rank creates every group, in the same order). Call before activation checkpointing and
    FSDP2 (``fully_shard`` then shards the DTensors over ``dp_shard``: a 2-D layout).

    Raises:
        ValueError: as :func:`apply_tensor_parallel`.
    """
    if dims.tp == 1:
        return None
    mesh = dims.build_mesh(device_type) if mesh is None else mesh
    plan = apply_tensor_parallel(model, mesh["tp"])
    peers = ("dp", "dp_shard", "cp")
    group = dims.new_group(peers, rank)  # one rank without DP/CP peers: the sum is a no-op
    return RankTensorParallel(plan, dims.tp, group, dims.world_size // dims.pp)
