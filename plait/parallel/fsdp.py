"""Sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``) per pipeline unit, frozen-aware.

What is plait's own here, the rest is PyTorch's:

- **Groups = pipeline units.** Each trainable unit (encoder embeddings / layer / post-norm / projector, LLM
  embeddings / layer / norm / head; :func:`plait.models.units.unit_specs`) is one ``fully_shard`` group, so its
  parameters are all-gathered just before its forward (and again before its backward) and its gradients
  reduce-scattered as soon as its backward is done: the reduction overlaps the backward of the units before it.
  Each group is its own FSDP2 root (plait calls encoder and embedding modules outside any enclosing forward), so a
  unit made of several modules (Whisper's ``conv1, conv2, embed_positions``) gives one group per module. Inside a
  unit, every maximal submodule whose parameters all train while others in the unit do not (LoRA's ``lora_A`` /
  ``lora_B``) is its own group first: a group keeps one ``requires_grad`` and one dtype.
- **Tied parameters are sharded once**: the modules of several units that share a parameter (tied LLM embeddings
  and head) form ONE group, ``fully_shard([embedding, head])`` (FSDP2's grouped modules: gathered at the first
  module's forward, resharded after the last one's, the gradients of both uses summed before one reduce-scatter,
  which the group's final backward callback runs after the embedding's backward). The group belongs to the first
  module's unit (the embedding's). Under pipeline parallelism an embedding tied to a head on another pipeline rank
  (``replicate``: ``RankStages.tied``) stays replicated, its gradient summed like DDP's
  (:attr:`ShardedModel.replicated`, ``plait.parallel.tensor_parallel.sum_local_gradients``).
- **Parameters read without their module's call stay replicated** (Qwen2-Audio's and Voxtral's
  ``embed_positions.weight``, which the tower's forward adds itself: ``ModalityEncoder.read_uncalled``): FSDP2
  all-gathers a group in its module's pre-forward hook, so such a parameter would reach the forward still a sharded
  DTensor. Its module is left outside FSDP2 like a pipeline-tied embedding (:attr:`ShardedModel.replicated`), its
  gradient summed over the data-parallel ranks.
- **Frozen units stay replicated**, outside FSDP: they have no gradient or optimizer state to shard, their
  parameters are 1/8 of the bytes a trained parameter costs under AdamW (2 of 16 in bf16), and sharding them
  would add an all-gather to every microbatch's forward and make every rank join the collectives of encoders
  its share of the batch may not run. A fully frozen part is therefore never wrapped and never reduced.
- **Sums, not means**: the trainer already scales each loss by 1 / the global batch's target tokens, so the
  groups reduce with divide factor 1 (the sum over the ``dp x dp_shard`` ranks, like ``sum_gradients``).
- **CPU offload** (``parallel.offload = "cpu"``, FSDP2's ``CPUOffloadPolicy``): the shards, their gradients and
  so AdamW's state and step live on the host; each group's shard is copied to the device before its all-gather and
  its reduce-scattered gradient back. Without pipeline stages only (``config.loader`` refuses it with ``pp`` > 1).
- **Gradient reduction over microbatches** (without pipeline stages, ``parallel.fsdp_reduce``): ``"step"`` turns
  gradient sync off until the last microbatch (``train.step_run``), so every group's gradient accumulates unsharded
  and is reduce-scattered once; ``"microbatch"`` (:attr:`ShardedModel.reduce_each_microbatch`) keeps sync on, as CPU
  offload does: one reduce-scatter per microbatch, the shards accumulate (``planner.sharding`` charges both).
- **Resharding after the forward** (without pipeline stages, ``parallel.fsdp_reshard``): ``"after_forward"``
  (:attr:`ShardedModel.reshard_after_forward`, FSDP2's default) frees each group's gathered parameters after its
  forward and all-gathers them again for its backward; ``"after_backward"`` keeps them from the forward to the end of
  the backward (torchtitan's ``reshard_after_forward = False``; ZeRO-2 within the microbatch): one all-gather per
  group per microbatch instead of two, for the unsharded parameters of every unit whose backward is pending
  (``planner.sharding`` charges them). Every trainable group's forward is followed by its backward before the
  optimizer step (:mod:`plait.train.step_run`), which reshards it; forwards without a backward run inside
  :func:`gathered`.
- **Mixed precision** on GPU: bf16 parameters for compute, fp32 gradient reduction and fp32 master weights
  (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``); fp32 throughout on CPU.

Without pipeline stages every rank must run the same sequence of forwards and backwards through the sharded
groups (their all-gathers and reduce-scatters are collectives): :mod:`plait.train.step_run` makes the trainer's
step uniform.

**Under pipeline parallelism** (each rank shards only its own stages' units over the ``dp_shard`` ranks of its
stage) a step runs the schedule's F/B/W actions, whose count and content differ between the shard ranks (a share
without an image, deferred encoder backwards, empty LLM microbatches). So FSDP2 runs no collective inside them:
:meth:`ShardedModel.begin_step` all-gathers every group of the rank once at the start of the step (in the same
order on every shard rank) and keeps the parameters unsharded through it (``reshard_after_forward`` and
``reshard_after_backward`` off, gradient sync off: the microbatches' gradients accumulate unsharded), and
:meth:`ShardedModel.reduce_gradients` reduce-scatters a stage's groups once, right after the stage's last backward
action of the step (the same point of the same schedule on every shard rank), then reshards them. A parameter that
got no gradient on a rank (its share had no image) contributes zeros (``set_reduce_scatter_unused_params``); a
module that no rank used in the step ends with no gradient (:meth:`ShardedModel.drop_gradients`, called by the
pipeline trainer), as in one process. This
is the pattern of ``torch.distributed.pipelining``'s ``REDUCE_GRAD`` action and of torchtitan's
``reshard_after_forward = not pp_enabled``: between steps parameters, gradients and optimizer state are sharded;
within a step the stage's parameters and gradients are whole (``planner.sharding`` charges this).
Source: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``), torchtitan's per-block wrapping.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from plait.models.units import UnitSpec

__all__ = ["ShardedModel", "apply_fsdp", "gathered", "mixed_precision", "offload_policy", "read_uncalled"]


@dataclass
class ShardedModel:
    """The FSDP2 groups of a model, by module (``"llm"`` or an encoder branch name), in forward order.

    Attributes:
        groups: per module, the ``FSDPModule`` groups holding its trainable units (adapter groups first).
        names: per group (same order as :meth:`all_groups`), the unit name it was built for (`` (adapter)`` added
            for an adapter group, `` (tied)`` for the group of the modules sharing a tied parameter).
        replicated: trainable parameters left outside FSDP2 (tied to a unit on another pipeline rank): their
            gradients are summed over the data-parallel and CP ranks by ``sum_local_gradients``.
        units: per group (same order), the unit name alone.
        holders: by ``id`` of a tied group, its FSDP2 root (``_holder``: a grouped state cannot be a root).
        offload: the groups offload to the host (``parallel.offload = "cpu"``): gradients are then reduce-scattered
            after every microbatch's backward (:meth:`set_gradient_sync` keeps it on), so the unsharded gradients
            never accumulate on the device; the shards accumulate on the host.
        reduce_each_microbatch: ``parallel.fsdp_reduce = "microbatch"``: as under :attr:`offload`, gradients are
            reduce-scattered after every microbatch's backward and the shards accumulate on the device (one unit's
            unsharded gradient at a time instead of all of them, for one reduction per microbatch).
        reshard_after_forward: each group frees its all-gathered parameters after its forward and gathers them again
            for its backward (``parallel.fsdp_reshard = "after_forward"``), or keeps them from its forward to the end
            of its backward (``"after_backward"``: one all-gather per microbatch instead of two, the unsharded
            parameters of every unit whose backward is pending held at once). :func:`gathered` restores it.
        collective: modules (``"llm"``) whose forward runs collectives outside FSDP2 (expert parallelism's
            all-to-alls): every rank must run them like a sharded module's (:meth:`sharded`).
    """

    groups: dict[str, list[FSDPModule]] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    replicated: list[nn.Parameter] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    holders: dict[int, FSDPModule] = field(default_factory=dict)
    offload: bool = False
    reduce_each_microbatch: bool = False
    reshard_after_forward: bool = True
    collective: frozenset[str] = frozenset()

    def all_groups(self) -> list[FSDPModule]:
        """Every group, module by module."""
        return [g for groups in self.groups.values() for g in groups]

    def groups_of(self, units: Collection[str]) -> list[FSDPModule]:
        """The groups built for the units named ``units`` (a pipeline stage's), in :meth:`all_groups` order."""
        return [g for g, unit in zip(self.all_groups(), self.units) if unit in units]

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter FSDP2 shards (each once; the sharded DTensors between steps)."""
        seen: dict[int, nn.Parameter] = {}
        for g in self.all_groups():
            seen.update((id(p), p) for p in g.parameters())  # type: ignore[attr-defined]
        return list(seen.values())

    def begin_step(self) -> None:
        """Pipeline step start (module docstring): every group all-gathered once (collective over each group's
        shard ranks, in :meth:`all_groups` order) and kept unsharded through the step; its gradients accumulate
        unsharded until :meth:`reduce_gradients`."""
        for g in self._roots():
            _state(self.holders.get(id(g), g))  # resolve the roots before any forward (a group may run none)
        for g in self.all_groups():
            g.set_reshard_after_forward(False, recurse=False)
            g.set_reshard_after_backward(False, recurse=False)
            g.set_requires_gradient_sync(False, recurse=False)
            g.set_reduce_scatter_unused_params(True, recurse=False)
            g.set_is_last_backward(False)
        for g in self.all_groups():
            g.unshard()

    def reduce_gradients(self, groups: Sequence[FSDPModule]) -> None:
        """Reduce-scatter (HSDP: then all-reduce over the replicas) the gradients ``groups`` accumulated since
        :meth:`begin_step`, once, and reshard their parameters: each parameter's ``.grad`` becomes its summed
        shard. Collective over each group's shard ranks, which call it with the same groups in the same order (a
        parameter without a gradient on this rank sends zeros). FSDP2 has no public call for a reduction outside
        autograd; this is the call ``torch.distributed.pipelining``'s ``perform_reduce_grad`` makes."""
        for g in groups:
            g.set_requires_gradient_sync(True, recurse=False)
            g.set_reshard_after_backward(True, recurse=False)
            g.set_is_last_backward(True)
            for param_group in _state(g)._fsdp_param_groups:
                param_group.post_backward()
        roots = {id(g) for g in self._roots()}
        for g in groups:
            if id(g) in roots:  # waits for the reductions, finalizes the grads
                _state(self.holders.get(id(g), g))._root_post_backward_final_callback()

    def drop_gradients(self, modules: Collection[str]) -> None:
        """Set the gradient of every parameter of ``modules``' groups (encoder branches, ``"llm"``) to ``None``: a
        module that no rank used in the step, whose reduction under pipeline parallelism still gave its groups
        zeros (:meth:`reduce_gradients`). Then AdamW skips them (no weight decay, no step of their state), as in
        one process. Not collective: every rank of the groups passes the same ``modules`` (decided from the global
        batch, which every rank knows)."""
        for module in modules:
            for g in self.groups.get(module, []):
                for p in g.parameters():  # type: ignore[attr-defined]
                    p.grad = None

    def _roots(self) -> list[FSDPModule]:
        """The unit groups (an adapter group sits inside its unit's group, whose FSDP2 state is its root; a tied
        group's root is its holder, :attr:`holders`)."""
        return [g for g, name in zip(self.all_groups(), self.names) if not name.endswith("(adapter)")]

    def sharded(self, module: str) -> bool:
        """Whether ``module`` (``"llm"`` or a branch) has a sharded group or is :attr:`collective` (then every rank
        must run it)."""
        return bool(self.groups.get(module)) or module in self.collective

    def set_gradient_sync(self, sync: bool, module: str | None = None) -> None:
        """Reduce-scatter gradients at the end of each group's backward (``sync``) or accumulate them unsharded
        (microbatches before the last), for ``module``'s groups (default: all). Under :attr:`offload` or
        :attr:`reduce_each_microbatch` always reduce-scatter (the shards accumulate)."""
        always = self.offload or self.reduce_each_microbatch
        for group in self.all_groups() if module is None else self.groups.get(module, []):
            group.set_requires_gradient_sync(sync or always, recurse=False)


def mixed_precision(device_type: str) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 reduction on GPU (the master weights stay fp32: FSDP2 casts a copy); fp32 on CPU."""
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, specs: Sequence[UnitSpec], mesh: Any, device_type: str,
               replicate: Collection[nn.Parameter] = (), offload: bool = False,
               reduce_each_microbatch: bool = False, reshard_after_forward: bool = True,
               ignored: Collection[nn.Parameter] = ()) -> ShardedModel:
    """Shard, in place, the trainable units of ``model`` over ``mesh`` (module docstring for the rules).

    Args:
        model: the composite (whole, or a pipeline rank's pruned composite: units it does not hold are skipped),
            freezing applied and activation checkpointing already applied (the checkpointed forward then runs
            inside the group, so its recomputation finds the parameters all-gathered).
        specs: ``plait.models.units.unit_specs`` of the whole model.
        mesh: a 1-D ``("dp_shard",)`` DeviceMesh (FSDP) or 2-D ``("dp", "dp_shard")`` (HSDP: replicate over
            ``dp``, shard over ``dp_shard``).
        device_type: ``"cuda"`` (bf16 mixed precision) or ``"cpu"``.
        replicate: parameters to keep replicated, outside FSDP2 (a pipeline rank's embedding tied to the head on
            another rank: ``RankStages.tied``); parameters tied between units of ``model`` are one group instead.
            The encoders' :func:`read_uncalled` parameters are added to them (the module holding one stays whole).
        offload: CPU offload (``parallel.offload = "cpu"``, :func:`offload_policy`): every group's shards, their
            gradients (and so the optimizer state and step) on the host.
        reduce_each_microbatch: ``parallel.fsdp_reduce = "microbatch"`` (:class:`ShardedModel`).
        reshard_after_forward: ``fully_shard``'s flag for every group (``parallel.fsdp_reshard``,
            :attr:`ShardedModel.reshard_after_forward`); pipeline steps override it (:meth:`ShardedModel.begin_step`).
        ignored: parameters FSDP2 leaves alone (``fully_shard(ignored_params=...)``): expert weights split by expert
            parallelism (:mod:`plait.parallel.expert_parallel`), whose gradients are summed on their own.

    Returns:
        The groups made, by module.

    Raises:
        ValueError: when modules sharing a tied parameter hold frozen parameters next to trained ones, or a module
            holds both of its own (FSDP2 needs one ``requires_grad`` per group).
    """
    out = ShardedModel(offload=offload, reduce_each_microbatch=reduce_each_microbatch,
                       reshard_after_forward=reshard_after_forward)
    policy = _Policy(mixed_precision(device_type), offload_policy(device_type, offload), reshard_after_forward,
                     frozenset(ignored))
    units = [(s.unit.module, s.unit.name, [m for m in map(lambda p: _held(model, p), s.modules) if m is not None])
             for s in specs]
    kept = {id(p) for p in [*replicate, *read_uncalled(model)]}
    tied = _tied(units) - kept
    done: set[int] = set()  # modules already placed in a (tied) group
    seen: set[int] = set()  # parameters already in out.replicated
    for module, unit, modules in units:
        for m in modules:
            params = list(m.parameters())
            if id(m) in done or not any(p.requires_grad for p in params):
                continue  # frozen: replicated, no gradient, no collective
            if any(id(p) in kept for p in params):
                out.replicated += [p for p in params if p.requires_grad and id(p) not in seen]
                seen.update(id(p) for p in params)
                continue
            groups = out.groups.setdefault(module, [])
            if any(id(p) in tied for p in params):
                sharing = _sharing(m, tied, units)
                if not all(p.requires_grad for s in sharing for p in s.parameters()):
                    raise ValueError(f"{unit}: modules tied to it hold frozen parameters next to trained ones: "
                                     "FSDP2 needs one requires_grad per group; freeze or train them together")
                done.update(id(s) for s in sharing)
                groups.append(_shard(sharing, mesh, policy))
                out.holders[id(groups[-1])] = _holder(sharing, mesh, policy)
                out.names.append(f"{unit} (tied)")
                out.units.append(unit)
                continue
            if not all(p.requires_grad for p in params):
                for island in _trainable_islands(m):
                    groups.append(_shard(island, mesh, policy))
                    out.names.append(f"{unit} (adapter)")
                    out.units.append(unit)
            groups.append(_shard(m, mesh, policy))
            out.names.append(unit)
            out.units.append(unit)
    return out


def read_uncalled(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model``'s encoder towers (a composite, whole or a pipeline rank's pruned one) that a
    tower's forward reads without calling the module holding them (``ModalityEncoder.read_uncalled``, found by its
    probe: Qwen2-Audio's and Voxtral's ``embed_positions.weight``); those this rank holds."""
    out = []
    for branch in getattr(model, "encoders", {}).values():
        for name in getattr(branch, "read_uncalled", ()):
            try:
                out.append(branch.encoder.get_parameter(name))
            except AttributeError:  # pruned: another pipeline rank's unit
                continue
    return out


class _Holder(nn.Module):
    """A module over a tied group's modules, outside the model, never run: their FSDP2 root (:func:`_holder`)."""

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)

    def forward(self, *_: Any) -> None:
        raise RuntimeError("the FSDP2 root of a tied group is never run: its members are called on their own")


def _holder(sharing: list[nn.Module], mesh: Any, policy: _Policy) -> FSDPModule:
    """The FSDP2 root of a tied group: FSDP2 needs one root module per state tree and a grouped state cannot be one,
    so a parameterless :class:`_Holder` of the group's modules (outside the model) is sharded over them and
    initialised before the first of them runs (a pre-forward hook ahead of FSDP2's): the tied group then runs as its
    non-root child, each module called on its own."""
    holder = _shard(_Holder(sharing), mesh, policy)

    def init_root(*_: Any) -> None:
        _state(holder)  # idempotent: FSDP2's lazy init of the root and its tied child

    for m in sharing:
        m.register_forward_pre_hook(init_root, prepend=True)
    return holder


def _sharing(first: nn.Module, tied: set[int], units: Sequence[tuple[str, str, list[nn.Module]]]) -> list[nn.Module]:
    """``first`` and every module of ``units`` sharing a tied parameter with it, transitively, in unit order: one
    FSDP2 group (``fully_shard([embedding, head])``), so the tied parameter is sharded once. Its group is the first
    module's unit's (the embedding's, whose backward comes last: the reduction waits for both uses)."""
    group, params = [first], {id(p) for p in first.parameters()} & tied
    grown = True
    while grown:
        grown = False
        for _, _, modules in units:
            for m in modules:
                if all(m is not g for g in group) and params & {id(p) for p in m.parameters()}:
                    group.append(m)
                    params |= {id(p) for p in m.parameters()} & tied
                    grown = True
    return group


def offload_policy(device_type: str, offload: bool) -> OffloadPolicy:
    """FSDP2's offload policy: ``CPUOffloadPolicy`` (sharded parameters and gradients in host memory, pinned on
    CUDA for asynchronous copies; the optimizer step then runs on the host) when ``offload``, else none."""
    return CPUOffloadPolicy(pin_memory=device_type == "cuda") if offload else OffloadPolicy()


@dataclass(frozen=True)
class _Policy:
    """What every ``fully_shard`` call of one model shares (:func:`apply_fsdp`)."""

    mp: MixedPrecisionPolicy
    offload: OffloadPolicy
    reshard_after_forward: bool
    ignored: frozenset[nn.Parameter] = frozenset()


def _shard(modules: nn.Module | list[nn.Module], mesh: Any, policy: _Policy) -> FSDPModule:
    """``fully_shard`` of ``modules`` (one group; a list: one grouped state) under ``policy``, reducing plain sums."""
    group = fully_shard(modules, mesh=mesh, reshard_after_forward=policy.reshard_after_forward, mp_policy=policy.mp,
                        offload_policy=policy.offload, ignored_params=set(policy.ignored) or None)
    group = group[0] if isinstance(group, list) else group  # several modules share one state: any handles it
    group.set_gradient_divide_factor(1.0)
    group.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM; the factor is 1)
    return group


def _state(group: FSDPModule) -> Any:
    """The FSDP2 state of ``group``, lazily initialised (what its first forward would do: a unit group becomes
    the root of its adapter groups)."""
    state = group._get_fsdp_state()
    state._lazy_init()
    return state


def _tied(units: Sequence[tuple[str, str, list[nn.Module]]]) -> set[int]:
    """Ids of the parameters held by modules of more than one unit (tied embeddings and head)."""
    count: dict[int, int] = {}
    for _, _, modules in units:
        for i in {id(p) for m in modules for p in m.parameters()}:
            count[i] = count.get(i, 0) + 1
    return {i for i, n in count.items() if n > 1}


def _held(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:  # a pipeline rank's pruned composite holds only its own units
        return None


def _trainable_islands(module: nn.Module) -> list[nn.Module]:
    """The maximal submodules of ``module`` whose parameters all train (LoRA adapters in a frozen base).

    Raises:
        ValueError: when a module holds trainable parameters of its own next to frozen ones.
    """
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        params = list(m.parameters())
        if params and all(p.requires_grad for p in params) and type(m).forward is not nn.Module.forward:
            out.append(m)  # (a container without forward, as peft's lora_A ModuleDict, is entered instead)
            return
        for child in m.children():
            visit(child)

    for sub in module.modules():
        own = list(sub.parameters(recurse=False))
        if any(p.requires_grad for p in own) and not all(p.requires_grad for p in own):
            raise ValueError(f"{type(sub).__name__} holds trainable and frozen parameters of its own: FSDP2 needs "
                             "one requires_grad per group; freeze or train the whole module")
    for child in module.children():
        visit(child)
    return out


@contextmanager
def gathered(sharded: ShardedModel | None) -> Iterator[None]:
    """Within: every group's parameters all-gathered once (collective, same order on every rank) and kept, so the
    forwards inside (evaluation, generation: different counts per rank) run no collective. Resharded on exit."""
    groups = sharded.all_groups() if sharded is not None else []
    for g in groups:
        g.unshard()
        g.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for g in groups:
            g.reshard()
            g.set_reshard_after_forward(sharded.reshard_after_forward, recurse=False)  # type: ignore[union-attr]


