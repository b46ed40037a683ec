"""Expert parallelism (EP) for the mixture-of-experts layers of a model's LLM, through their public module structure.

A Hugging Face MoE layer (Qwen3-MoE, Qwen3-VL-MoE, ...) is a sparse block whose router picks ``k`` experts per token
and an experts module holding every expert's weights as 3-D parameters, ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``, called as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``.
:func:`apply_expert_parallel` splits each experts module over the ``ep`` ranks of its EP group
(:meth:`plait.parallel.dims.ParallelDims.expert_groups`): rank ``j`` keeps experts ``[j E/ep, (j+1) E/ep)`` as the
local shard of a DTensor parameter (``Shard(0)`` on a 1-D ``("ep",)`` mesh; so checkpoints written through DCP
reshard across EP degrees), and the module's forward becomes, per call (GShard, Lepikhin et al. 2020, section 2;
Megatron-Core's and torchtitan's token dispatch):

1. every (token, slot) pair goes to the rank owning its expert: pairs sorted by owner, the counts exchanged, the
   token rows and their local expert ids sent with ``all_to_all_single`` (autograd-aware: the backward sends the
   gradients back the same way);
2. the owner runs the layer's own experts implementation (the class's forward, whichever
   ``config._experts_implementation`` selects) on the rows it received, over its local experts only, each row with
   its one expert and weight 1;
3. the outputs go back with ``all_to_all_single`` and are summed into each token's row, times its router weight
   (so the router's gradient stays on the token's rank).

Every rank of an EP group must run the same MoE forwards and backwards in the same order (the all-to-alls are
collectives): the flat step runs every LLM microbatch on every rank (a dummy one where a rank has none), and a rank
whose tokens route to no local expert still joins both exchanges with zero-size splits. Evaluation, whose ranks run
different samples, runs inside :meth:`ExpertParallel.whole` (every expert gathered once, no all-to-all), as FSDP2's
``gathered``. Expert gradients are summed
over the expert-data-parallel group (:meth:`ExpertParallel.reduce_gradients`); the other parameters keep their DP /
FSDP2 sum. Pure DP in plait broadcasts nothing at start: every rank materialises the same weights from the seed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from plait.parallel.dims import ParallelDims, new_groups
from plait.parallel.tensor_parallel import sum_local_gradients

__all__ = ["EXPERT_WEIGHTS", "ExpertParallel", "apply_expert_parallel", "experts_modules", "is_expert_parameter"]

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""The fused expert parameters (leading dimension: the expert) of the experts modules EP splits."""


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model`` (name, module): every module with an integer ``num_experts`` and 3-D
    :data:`EXPERT_WEIGHTS` parameters whose leading dimension is the expert count (Hugging Face's fused experts)."""
    out = []
    for name, m in model.named_modules():
        weights = [m._parameters.get(w) for w in EXPERT_WEIGHTS]
        if isinstance(getattr(m, "num_experts", None), int) and all(
                w is not None and w.dim() == 3 and w.shape[0] == m.num_experts for w in weights):
            out.append((name, m))
    return out


def is_expert_parameter(p: torch.Tensor) -> bool:
    """Whether ``p`` is an expert weight split by :func:`apply_expert_parallel` (a DTensor on an ``("ep",)``
    mesh): its gradient is summed over the expert-data-parallel group, not the data-parallel one."""
    return isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("ep",)


@dataclass
class ExpertParallel:
    """This rank's expert parallelism.

    Attributes:
        ep: the EP degree.
        ep_rank: this rank's index in its EP group (it holds experts ``[ep_rank E/ep, (ep_rank+1) E/ep)``).
        group: the EP group (the all-to-alls).
        replica_group: the expert-data-parallel group (ranks holding the same experts), None when it is one rank.
        mesh: the 1-D ``("ep",)`` DeviceMesh of the expert DTensors.
        modules: the split experts modules, by name.
        params: the expert parameters (DTensors), in module order.
        device: the backend's device (where the small agreement tensors live: NCCL needs them on the GPU).
    """

    ep: int
    ep_rank: int
    group: Any
    replica_group: Any
    mesh: DeviceMesh
    modules: dict[str, nn.Module] = field(default_factory=dict)
    params: list[nn.Parameter] = field(default_factory=list)
    device: torch.device = torch.device("cpu")

    def reduce_gradients(self) -> None:
        """Make the expert gradients whole and summed: a trainable expert weight with a gradient on some rank of
        the EP group gets zeros on the ranks whose local experts got no token (one gradient over all ``E``
        experts, as in one process, where AdamW then steps every expert's rows), then the local shards are summed
        over the expert-data-parallel group (:func:`~plait.parallel.tensor_parallel.sum_local_gradients`: None
        where no rank has one). Collective over both groups."""
        trained = [p for p in self.params if p.requires_grad]
        if not trained:
            return
        flags = torch.tensor([p.grad is not None for p in trained], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        for p, flag in zip(trained, flags.tolist()):
            if flag and p.grad is None:
                p.grad = DTensor.from_local(torch.zeros_like(p.to_local()), self.mesh, p.placements,
                                            run_check=False, shape=p.shape, stride=p.stride())
        if self.replica_group is not None:
            sum_local_gradients(trained, self.replica_group)


    @contextmanager
    def whole(self) -> Iterator[None]:
        """Within: every split experts module holds all its experts (each weight all-gathered once over the EP
        group, in module order: collective) and runs its own forward with no all-to-all, so the forwards inside
        (evaluation, generation: different samples and counts per rank) need no peer; the shards and the
        dispatching forward come back on exit. For forwards without a backward (the gathered weights are
        detached)."""
        kept = []
        for module in self.modules.values():
            shards = {w: module._parameters[w] for w in EXPERT_WEIGHTS}
            kept.append((module, shards, module.__dict__.pop("forward")))
            for w, shard in shards.items():
                module._parameters[w] = nn.Parameter(shard.full_tensor().detach(), requires_grad=False)
        try:
            yield
        finally:
            for module, shards, forward in kept:
                module._parameters.update(shards)
                module.forward = forward

    def check_microbatches(self, count: int, empty: int) -> None:
        """Under pipeline stages: refuse a step in which the EP ranks would run different LLM microbatches
        (``count`` this rank runs, ``empty`` of them without samples and so skipped by the LLM stages): their MoE
        all-to-alls would wait on each other. One all-reduce MAX over the EP group; every rank raises alike.

        Raises:
            ValueError: when the counts differ over the EP group or a rank has an empty LLM microbatch.
        """
        flags = torch.tensor([count, -count, empty], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        most, least, empties = flags.tolist()
        if most != -least or empties:
            raise ValueError(f"parallel.ep = {self.ep} under pipeline stages: the EP ranks of a stage would run "
                             f"{-least} to {most} LLM microbatches ({empties} empty at most); give every data-parallel "
                             "rank the same number of non-empty LLM microbatches (parallel.pp.microbatches, a "
                             "microbatch policy that does not defer, a global batch that divides evenly)")


def apply_expert_parallel(model: nn.Module, dims: ParallelDims, rank: int, device: torch.device
                          ) -> ExpertParallel | None:
    """Split the experts of ``model``'s MoE layers over ``dims.ep`` ranks in place (module docstring); None when
    ``dims.ep`` is 1. Call after the model is materialised (and pruned to a pipeline rank's stages: only the
    experts it holds are split) and before FSDP2, which must leave the expert parameters out. Every rank creates
    every EP and expert-data-parallel group (collective).

    Raises:
        ValueError: when the model has no MoE experts module, or ``dims.ep`` does not divide an expert count.
    """
    if dims.ep == 1:
        return None
    found = experts_modules(model)
    if not found and not _has_moe_config(model):
        raise ValueError(f"parallel.ep = {dims.ep} needs an LLM with mixture-of-experts layers (experts modules "
                         f"with fused {' / '.join(EXPERT_WEIGHTS)} weights); this model has none")
    for name, module in found:
        if module.num_experts % dims.ep:
            raise ValueError(f"{name}: parallel.ep = {dims.ep} does not divide its {module.num_experts} experts")
    ep_groups, replica_groups = dims.expert_groups()
    group = new_groups(ep_groups, rank)
    replica_group = new_groups(replica_groups, rank, dims.cp * dims.batch // dims.ep > 1)
    mine = next(g for g in ep_groups if rank in g)
    mesh = DeviceMesh.from_group(group, device.type, mesh=mine, mesh_dim_names=("ep",))
    out = ExpertParallel(dims.ep, dims.ep_rank(rank), group, replica_group, mesh, device=device)
    for name, module in found:
        _split(name, module, out)
    return out


def _has_moe_config(model: nn.Module) -> bool:
    """Whether the LLM's config names experts (a pipeline rank holding none of its MoE layers splits nothing)."""
    config = getattr(getattr(model, "language_model", None), "config", None)
    text = getattr(config, "text_config", None) or config
    return bool(getattr(text, "num_experts", 0) or getattr(text, "n_routed_experts", 0))


def _split(name: str, module: nn.Module, ep: ExpertParallel) -> None:
    """Keep ``module``'s local experts as DTensor shards and route its forward through :func:`_dispatch`."""
    local = module.num_experts // ep.ep
    for w in EXPERT_WEIGHTS:
        full = getattr(module, w)
        piece = full.detach()[ep.ep_rank * local:(ep.ep_rank + 1) * local].clone()
        shard = DTensor.from_local(piece, ep.mesh, [Shard(0)], run_check=False, shape=full.shape,
                                   stride=full.stride())
        param = nn.Parameter(shard, requires_grad=full.requires_grad)
        setattr(module, w, param)
        ep.params.append(param)
    ep.modules[name] = module
    forward = type(module).forward

    def dispatched(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                   ) -> torch.Tensor:
        return _dispatch(module, forward, local, ep, hidden_states, top_k_index, top_k_weights)

    module.forward = dispatched


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows whose backward sends the gradients back the reverse way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _exchange_ints(values: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: Any
                   ) -> torch.Tensor:
    """``all_to_all_single`` of an int64 vector (no gradient)."""
    out = values.new_empty(sum(out_splits))
    dist.all_to_all_single(out, values.contiguous(), list(out_splits), list(in_splits), group=group)
    return out


def _dispatch(module: nn.Module, forward: Any, local: int, ep: ExpertParallel, hidden: torch.Tensor,
              top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The EP forward of ``module`` (module docstring): ``hidden [T, H]``, ``top_k_index [T, k]`` (global expert
    ids), ``top_k_weights [T, k]`` -> ``[T, H]``. Collective over the EP group (three all-to-alls forward, two
    backward)."""
    k = top_k_index.shape[-1]
    experts = top_k_index.reshape(-1)
    owner = torch.div(experts, local, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    token = torch.div(order, k, rounding_mode="floor")
    send = torch.bincount(owner, minlength=ep.ep).to(torch.int64)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep.group)
    in_splits, out_splits = send.tolist(), recv.tolist()
    rows = _AllToAll.apply(hidden[token], out_splits, in_splits, ep.group)
    ids = _exchange_ints((experts - owner * local)[order], out_splits, in_splits, ep.group)
    shell = _local_view(module, local)
    out = forward(shell, rows, ids[:, None], torch.ones(ids.shape[0], 1, dtype=rows.dtype, device=rows.device))
    if rows.requires_grad and out.grad_fn is None:  # no row reached a local expert: keep the backward's exchange
        out = out + 0 * rows
    back = _AllToAll.apply(out, in_splits, out_splits, ep.group)
    weights = top_k_weights.reshape(-1)[order].to(back.dtype)
    return torch.zeros_like(hidden).index_add(0, token, (back * weights[:, None]).to(hidden.dtype))


def _local_view(module: nn.Module, local: int) -> nn.Module:
    """A shallow copy of experts ``module`` that sees only this rank's ``local`` experts: its expert weights the
    local shards of the DTensor parameters (gradients flow back into them), ``num_experts`` = ``local``."""
    shell = object.__new__(type(module))
    shell.__dict__.update(module.__dict__)
    shell.__dict__["_parameters"] = {n: p for n, p in module._parameters.items() if n not in EXPERT_WEIGHTS}
    for w in EXPERT_WEIGHTS:
        shell.__dict__[w] = getattr(module, w).to_local()
    shell.__dict__["num_experts"] = local
    return shell
