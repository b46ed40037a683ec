"""Plan -> this rank's pipeline stage modules.

Materialisation: the caller builds the composite on the meta device and materialises only this rank's
units (:func:`plait.models.init.materialize` with :func:`plait.models.init.rank_prefixes`: per-module init
keyed on (seed, FQN), or owned tensors only from a checkpoint), then :func:`build_rank_stages` prunes it in
place to the units this pipeline rank owns: non-owned embeddings, norms, heads and projectors become
``nn.Identity``, layer lists keep only the owned layers (under their original indices, so parameter names
stay the composite's FQNs and checkpoints map one to one), and what is left moves to the device. A fully
materialised composite works too (tests).

A stage runs stock Hugging Face modules through their public interfaces only (``plait.models.hf``):

- encoder chunk owning the embedding: the HF encoder's own ``forward`` with its layer list set to the
  chunk's layers and the post-norm set to ``nn.Identity`` unless the chunk owns it; other chunks call their
  layers one by one then the post-norm if owned, through the family's per-call hook
  (:func:`plait.models.tower_call.tower_call`: rotary tables, sequence boundaries, window indices recomputed on
  this stage from the item group's metadata in ``batch.modality_inputs``; the stock output a stage takes). The
  branch's last chunk selects positions, assembles item features and applies the projector (the same
  ``ModalityEncoder`` methods as the single-process path).
- LLM chunk: the HF decoder stack with ``inputs_embeds`` = the received hidden states (HF computes rotary
  embeddings and masks itself), layer list = the chunk's layers, final norm ``nn.Identity`` unless owned (a
  chunk of the final norm alone calls the norm: the stack runs its layers then its norm, ``LlmLayout``); the
  chunk owning ``lm_head`` runs the ``*ForCausalLM`` forward (so logit post-processing stays HF's) and
  the loss. The first LLM chunk merges text embeddings and projected features with
  ``MultimodalModel.place_features``, exactly like the single-process model. Under context parallelism
  (a ``plait_cp`` shard in the LLM kwargs) LLM chunks hold only the shard's tokens (``_LlmChunk.forward``);
  encoder chunks are unchanged (they run whole on every CP rank). DeepStack features (added after the LLM's first
  layers, :mod:`plait.models.deepstack`) reach the stages holding those layers with the hidden states: each LLM
  stage sends on the rows of its (shard's) visual tokens for the receiving layers of later stages, so the plan's
  edges, the schedules and deferral (which concerns the encoder-to-first-LLM-stage hop only) stay as they are.

The module swaps for one chunk happen only for the duration of its call, so a rank may hold several stages
of one module (e.g. the first and last LLM stages, which keeps tied embeddings on one rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.data.collate import Batch
from plait.models.deepstack import (DEEPSTACK_KWARG, DeepStackFeatures, carried_rows, deepstack_mask,
                                    received_features)
from plait.models.encoder import ModalityEncoder
from plait.models.families.base import EncoderLayout
from plait.models.hf import encoder_layout, llm_layout
from plait.models.multimodal import MultimodalModel
from plait.models.tower_call import TOWER_CALLS, TowerCall, tower_call
from plait.models.units import UnitSpec, unit_specs
from plait.parallel.context import shard_tokens
from plait.parallel.encoder_rows import merge_replica_features, replica_inputs
from plait.planner.pipeline.plan import check_plan_units
from plait.planner.pipeline.types import PipelinePlan, Stage
from plait.planner.types import LLM_MODULE

__all__ = ["OwnedLayers", "PipelineStage", "RankStages", "TiedEmbedding", "build_rank_stages", "Payload"]

# What flows along a plan edge: per module, a list of tensors (an encoder branch: one hidden-state tensor per item
# group, [n, positions, dim] or a packed tower's [patches, dim] (Qwen2.5-VL, window order) / [1, patches, dim]
# (Pixtral), or after its projector one [features, hidden] tensor; the LLM:
# [hidden [B, N, H]], then the DeepStack rows of later stages' receiving layers when there are any; the last stage:
# [loss sum]). An empty list means the module had no input this microbatch.
Payload = dict[str, list[torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class OwnedLayers(nn.ModuleList):
    """The owned subset of a layer list, registered under the original indices (FQNs unchanged).

    Iteration, ``len`` and slicing follow the owned layers in order (what HF forwards do with their list);
    integer indexing is positional too.
    """

    def __init__(self, modules: Sequence[nn.Module] = (), indices: Sequence[int] | None = None) -> None:
        super().__init__()
        indices = list(range(len(modules))) if indices is None else list(indices)
        for index, module in zip(indices, modules):
            self.add_module(str(index), module)

    def __getitem__(self, idx: int | slice) -> Any:
        values = list(self._modules.values())
        if not isinstance(idx, slice):
            return values[idx]
        if idx.step in (None, 1) and len(values[idx]) == len(values):
            return self  # every owned layer, in order (an HF forward's ``layers[:num_hidden_layers]``): no new list
        return nn.ModuleList(values[idx])

    def indexed(self) -> list[tuple[int, nn.Module]]:
        """``(original index, layer)`` of the owned layers, in order."""
        return [(int(key), module) for key, module in self._modules.items()]


@contextmanager
def _swapped(root: nn.Module, replacements: Mapping[str, nn.Module]) -> Iterator[None]:
    """Set submodules of ``root`` (by path) for the duration of the block, then restore them."""
    slots = [(root.get_submodule(parent) if parent else root, name)
             for parent, _, name in (path.rpartition(".") for path in replacements)]
    saved = [getattr(owner, name) for owner, name in slots]
    try:
        for (owner, name), module in zip(slots, replacements.values()):
            setattr(owner, name, module)
        yield
    finally:
        for (owner, name), module in zip(slots, saved):
            setattr(owner, name, module)


@dataclass(frozen=True)
class _ChunkFlags:
    """Frozen-aware flags of one module chunk of a stage (from its units)."""

    trainable: bool
    needs_input_grad: bool

    @property
    def runs_grad(self) -> bool:
        return self.trainable or self.needs_input_grad


def _chunk_flags(specs: Sequence[UnitSpec]) -> _ChunkFlags:
    return _ChunkFlags(any(s.unit.trainable for s in specs), specs[0].unit.needs_input_grad)


class _EncoderChunk:
    """A contiguous run of one encoder branch's units inside a stage."""

    def __init__(self, name: str, branch: ModalityEncoder, specs: Sequence[UnitSpec]) -> None:
        self.name, self.branch, self.flags = name, branch, _chunk_flags(specs)
        self.layout: EncoderLayout = encoder_layout(branch.encoder)
        kinds = {s.unit.kind for s in specs}
        self.owns_embed, self.owns_norm, self.owns_projector = "embed" in kinds, "norm" in kinds, "projector" in kinds
        self.layers = _chunk_layers(branch.encoder, self.layout.layers, specs)
        # set for the duration of the embedding chunk's HF call: its layers, and no post-norm unless it owns it
        self.swaps: dict[str, nn.Module] = {self.layout.layers: self.layers}
        if self.layout.post_norm and not self.owns_norm:
            self.swaps[self.layout.post_norm] = nn.Identity()

    def forward(self, hidden: list[torch.Tensor] | None, inputs: Mapping[str, Any] | None) -> list[torch.Tensor]:
        """Output tensors of the chunk for one microbatch (``[]`` when the branch has no item in it)."""
        if inputs is None:
            return []
        encoder = self.branch.encoder
        if self.owns_embed:
            groups = self.branch.item_groups(inputs)
            with _swapped(encoder, self.swaps):
                hidden = [tower_call(encoder, kwargs).stock_output(encoder(**kwargs), self.owns_norm)
                          for kwargs, _ in groups]
        else:
            hidden = hidden or []
            hidden = [self._layers_and_norm(h, call) for h, call in zip(hidden, self._calls(inputs, len(hidden)))]
        if not self.owns_projector:
            return hidden
        selected = [self.branch.select_positions(h) for h in hidden]
        return [self.branch.projector(self.branch.assemble_features(dict(inputs), selected))]

    def _calls(self, inputs: Mapping[str, Any], groups: int) -> list[TowerCall]:
        """The per-call inputs of each of the ``groups`` item groups, recomputed from their metadata; a family
        without any (not in ``TOWER_CALLS``) gets the default, without building the groups' inputs."""
        encoder = self.branch.encoder
        if encoder.config.model_type not in TOWER_CALLS:
            return [TowerCall(encoder, {})] * groups
        return [tower_call(encoder, kwargs) for kwargs, _ in self.branch.item_groups(inputs)]

    def _layers_and_norm(self, hidden: torch.Tensor, call: TowerCall) -> torch.Tensor:
        """The chunk's layers (each under its original index) and owned post-norm on one group's ``hidden``."""
        for index, layer in self.layers.indexed():
            hidden = call.layer(layer, index, hidden)
        if self.owns_norm and self.layout.post_norm:
            hidden = call.post_norm(self.branch.encoder.get_submodule(self.layout.post_norm), hidden)
        return hidden


class _LlmChunk:
    """A contiguous run of LLM units inside a stage."""

    def __init__(self, model: MultimodalModel, specs: Sequence[UnitSpec]) -> None:
        self.model, self.flags = model, _chunk_flags(specs)
        llm = model.language_model
        self.layout = llm_layout(llm)
        kinds = {s.unit.kind for s in specs}
        self.owns_embed, self.owns_norm, self.owns_head = "embed" in kinds, "norm" in kinds, "head" in kinds
        self.layers = _chunk_layers(llm, self.layout.layers, specs)
        _check_layer_types(llm, [int(k) for k in self.layers._modules])
        # set for the duration of each call: the chunk's layers, and no final norm unless the chunk owns it
        self.swaps: dict[str, nn.Module] = {self.layout.layers: self.layers}
        if not self.owns_norm:
            self.swaps[self.layout.norm] = nn.Identity()

    def forward(
        self, received: Sequence[torch.Tensor], features: Mapping[str, torch.Tensor], batch: Batch,
        loss_fn: LossFn, llm_kwargs: Mapping[str, Any],
    ) -> list[torch.Tensor]:
        """``[hidden [B, N, H]]`` for the next stage, with the DeepStack rows for the receiving layers of later
        stages after it (``[visual tokens, later receivers * H]``, :func:`plait.models.deepstack.carried_rows`), or
        ``[loss sum]`` (scalar) on the ``lm_head`` chunk.

        ``received``: the previous LLM stage's payload (``[hidden]`` or ``[hidden, DeepStack rows]``; empty on the
        embedding chunk). With a context-parallel shard ``llm_kwargs["plait_cp"]``
        (:class:`~plait.parallel.context.CPShard`) the chunk works on the shard's ``n_local`` tokens only: the
        embedding chunk embeds the whole rows (the features of every item are placed) and keeps the shard's tokens,
        hidden states are ``[B, n_local, H]``, the DeepStack rows those of the shard's visual tokens, positions and
        labels are the shard's (global positions), and the loss is the sum over its tokens. An M-RoPE LLM rotates
        with ``batch.rope_position_ids`` ``[3, B, N]`` (the shard's along the last dim),
        :meth:`~plait.models.multimodal.MultimodalModel.llm_positions`.
        """
        shard = llm_kwargs.get("plait_cp")
        hidden = received[0] if received else None
        deepstack, carried = self._deepstack(batch, features, received[1] if len(received) > 1 else None, shard)
        if deepstack is not None:
            llm_kwargs = {**llm_kwargs, DEEPSTACK_KWARG: deepstack}
        if self.owns_embed:
            hidden = self.model.place_features(batch.input_ids, features)
            if shard is not None:
                hidden = shard_tokens(hidden, shard)
        if not (len(self.layers) or self.owns_norm or self.owns_head):
            return [hidden, *carried]  # type: ignore[list-item]
        llm = self.model.language_model
        if not (len(self.layers) or self.owns_head):  # the stack runs its layers then its norm (LlmLayout): only the
            return [llm.get_submodule(self.layout.norm)(hidden), *carried]  # norm, no mask or rotary tables to build
        labels, mask = batch.labels, batch.attention_mask
        positions = self.model.llm_positions(batch.position_ids, batch.rope_position_ids,
                                             tokens=batch.input_ids.shape[1])  # M-RoPE [3, B, N]
        if shard is not None:  # plait attention masks from plait_mask; the 2-D mask would not fit n_local tokens
            labels, mask = shard_tokens(labels, shard), None
            positions = shard_tokens(positions, shard, dim=positions.ndim - 1)
        kwargs = dict(inputs_embeds=hidden, attention_mask=mask, position_ids=positions, use_cache=False,
                      **llm_kwargs)
        with _swapped(llm, self.swaps):
            if self.owns_head:
                return [loss_fn(llm(**kwargs).logits, labels)]
            return [llm.get_submodule(self.layout.base)(**kwargs).last_hidden_state, *carried]

    def _deepstack(self, batch: Batch, features: Mapping[str, torch.Tensor], rows: torch.Tensor | None,
                   shard: Any) -> tuple[DeepStackFeatures | None, list[torch.Tensor]]:
        """The DeepStack additions (:mod:`plait.models.deepstack`) of the chunk's layers and the rows it sends on
        for the receiving layers of later stages (``[]`` when none): the embedding chunk computes them from the
        features (the shard's tokens under context parallelism); a later chunk rebuilds them from the ``rows`` the
        previous stage sent, which start at its first layer (the stages hold contiguous layers)."""
        receiving = self.model.deepstack_layers
        if not receiving:
            return None, []
        held = [int(k) for k in self.layers._modules]
        after = max(held) + 1 if held else 0  # the first layer of the later stages
        if self.owns_embed:
            extras = self.model.deepstack(batch.input_ids, features).get(DEEPSTACK_KWARG)
            if extras is not None and shard is not None:
                extras = extras.select(lambda t: shard_tokens(t, shard))
        elif rows is not None:
            if not held:
                return None, [rows]
            hidden = int(self.model.language_model.config.hidden_size)  # the embedding is pruned on this stage
            extras = received_features(rows, self._visual(batch, shard), hidden, first=min(held))
        else:
            return None, []
        if extras is None or after >= extras.end:
            return extras, []
        return extras, [carried_rows(extras, self._visual(batch, shard), max(after, extras.first))]

    def _visual(self, batch: Batch, shard: Any) -> torch.Tensor:
        """``[B, n]`` bool: the chunk's tokens (a shard's under context parallelism) that receive DeepStack
        additions."""
        mask = deepstack_mask(batch.input_ids, self.model.deepstack_placeholders)
        return mask if shard is None else shard_tokens(mask, shard)


def _chunk_layers(root: nn.Module, path: str, specs: Sequence[UnitSpec]) -> OwnedLayers:
    """The layers of a chunk's layer units, taken from ``root``'s (pruned) layer list at ``path``."""
    held = root.get_submodule(path)._modules  # original index -> layer
    layer_specs = [s for s in specs if s.unit.kind == "layer"]
    return OwnedLayers([held[str(s.layer)] for s in layer_specs], [s.layer for s in layer_specs])


def _check_layer_types(llm: nn.Module, layers: Sequence[int]) -> None:
    """Some HF decoders pick each layer's mask by its position in the list (``config.layer_types[i]``): a
    sub-range is only correct when the types at the local positions equal the layers' own types (checked for
    every family that has ``layer_types``, which is conservative for families that ask the layer itself)."""
    types = getattr(llm.config, "layer_types", None)
    if not types:
        return
    for local, index in enumerate(layers):
        if types[local] != types[index]:
            raise ValueError(
                f"LLM layer {index} is {types[index]!r} but would run as {types[local]!r} at position {local} of "
                "its stage: this family mixes layer types by position; choose stage boundaries at equal types"
            )


class PipelineStage:
    """One pipeline stage of the plan, executable on this rank.

    Args:
        stage: the plan's stage.
        chunks: per module of ``stage.modules``, its chunk.
        is_last: the stage computes the loss.
        modules: the modules of the stage's units, in unit order (their parameters are :attr:`params`).
    """

    def __init__(self, stage: Stage, chunks: Mapping[str, _EncoderChunk | _LlmChunk], is_last: bool,
                 modules: Sequence[nn.Module] = ()) -> None:
        self.stage, self.chunks, self.is_last = stage, dict(chunks), is_last
        self.unit_modules = list(modules)

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters of the stage's units, each once, in unit order; read from the modules at each call, so
        parameters replaced in place later (tensor parallelism's DTensors, FSDP2's shards) are the current ones."""
        params: dict[int, nn.Parameter] = {}
        for module in self.unit_modules:
            params.update((id(p), p) for p in module.parameters())
        return list(params.values())

    @property
    def index(self) -> int:
        return self.stage.index

    def module_runs_grad(self, module: str) -> bool:
        """Whether ``module``'s chunk records a graph (it trains or needs an input gradient)."""
        return self.chunks[module].flags.runs_grad

    def forward(
        self, batch: Batch | None, received: Mapping[int, Payload], loss_fn: LossFn, llm_kwargs: Mapping[str, Any]
    ) -> Payload:
        """The stage's output payload for one microbatch ``batch`` given the payloads of its predecessors
        (``Payload``: per module a list of tensors; see its comment for shapes).

        Chunks that neither train nor need an input gradient run under ``no_grad`` and keep no activations.
        The last stage returns ``{"llm": [sum of token cross-entropies]}``. ``batch`` None (a microbatch with
        no sample in this stage's view, possible with deferred encoder outputs) gives an empty list per module.
        A replica of a replicated encoder stage runs its slice of the branch's items only
        (:func:`~plait.parallel.encoder_rows.replica_inputs`; a copy of a tensor-parallel stage runs them all); an
        LLM stage concatenates the features of a
        replicated branch's replicas in replica order (:func:`~plait.parallel.encoder_rows.merge_replica_features`).
        """
        if batch is None:
            return {module: [] for module in self.chunks}
        inputs: Payload = merge_replica_features(list(received.values()))
        grad_allowed = torch.is_grad_enabled()
        out: Payload = {}
        for module, chunk in self.chunks.items():
            with torch.set_grad_enabled(grad_allowed and chunk.flags.runs_grad):
                if isinstance(chunk, _LlmChunk):
                    features = {m: t[0] for m, t in inputs.items() if m != LLM_MODULE and t}
                    out[module] = chunk.forward(inputs.get(LLM_MODULE, []), features, batch, loss_fn, llm_kwargs)
                else:
                    items = replica_inputs(batch.modality_inputs.get(module), module, self.stage.replica,
                                           self.stage.row_share)
                    out[module] = chunk.forward(inputs.get(module), items)
        return out


@dataclass(frozen=True)
class TiedEmbedding:
    """Input and output embeddings share one weight but live on two pipeline ranks: each holds a copy and
    their gradients are summed across the two ranks before the optimizer step, so the copies never drift.

    Attributes:
        peer: the other pipeline rank holding the weight.
        param: this rank's copy.
        mirror: True on the ``lm_head`` rank: its copy is left out of gradient norms (counted once).
    """

    peer: int
    param: nn.Parameter
    mirror: bool


class RankStages(nn.Module):
    """This pipeline rank's stages over the pruned composite (``self.model``, FQNs as in the full model).

    Attributes:
        model: the pruned :class:`MultimodalModel`; ``named_parameters``/``state_dict`` give owned parts only.
        plan: the pipeline plan.
        pp_rank: this rank's coordinate on the pipeline axis.
        stages: this rank's :class:`PipelineStage` by stage index.
        tied: the tied-embedding arrangement when embeddings are tied across ranks, else None.
    """

    def __init__(self, model: MultimodalModel, plan: PipelinePlan, pp_rank: int,
                 stages: Mapping[int, PipelineStage], tied: TiedEmbedding | None) -> None:
        super().__init__()
        self.model, self.plan, self.pp_rank = model, plan, pp_rank
        self.stages = dict(stages)
        self.tied = tied

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(FQN, parameter)`` of every owned parameter with ``requires_grad`` (empty when the rank's stages
        are frozen: such a rank builds no optimizer)."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]


def build_rank_stages(
    model: MultimodalModel, plan: PipelinePlan, pp_rank: int, device: torch.device | str | None = None
) -> RankStages:
    """Prune ``model`` in place to the units of ``pp_rank``'s stages and wrap them as executable stages.

    Args:
        model: the full composite with its final ``requires_grad`` flags (freezing applied); every rank of a
            pipeline must pass identical weights (same seed or checkpoint).
        plan: the pipeline plan; its units must be ``model_units(model)`` (checked).
        pp_rank: pipeline rank (``0..plan.num_ranks-1``).
        device: where the owned parts go (default: stay where they are).

    ``model`` is pruned in place (call once per model; take ``model_units`` before, not after).

    Raises:
        ValueError: when the plan does not fit the model's units or flags, ``pp_rank`` holds no stage, a
            trainable parameter belongs to no unit, or a family has no pipeline layout.
    """
    specs = unit_specs(model)
    check_plan_units(plan, [s.unit for s in specs])
    mine = plan.stages_on_rank(pp_rank)
    if not mine:
        raise ValueError(f"pipeline rank {pp_rank} holds no stage of a plan with {plan.num_ranks} ranks")
    _check_units_cover_trainable(model, specs)
    if len(plan.llm_stages) > 1:
        _check_inputs_embeds_pass_through(model.language_model)
    tied = _tied_embedding(model, plan, pp_rank, specs)
    owned = {name for s in mine for name in plan.stages[s].units}
    _prune(model, specs, owned)
    if device is not None:
        model.to(device)
    by_name = {s.unit.name: s for s in specs}
    stages = {s: _build_stage(model, plan, plan.stages[s], by_name) for s in mine}
    return RankStages(model, plan, pp_rank, stages, tied)


def _build_stage(
    model: MultimodalModel, plan: PipelinePlan, stage: Stage, by_name: Mapping[str, UnitSpec]
) -> PipelineStage:
    chunks: dict[str, _EncoderChunk | _LlmChunk] = {}
    for module in stage.modules:
        specs = [by_name[n] for n in stage.module_units(module)]
        if module == LLM_MODULE:
            chunks[module] = _LlmChunk(model, specs)
        else:
            chunks[module] = _EncoderChunk(module, model.encoders[module], specs)  # type: ignore[arg-type]
    modules = [model.get_submodule(path) for name in stage.units for path in by_name[name].modules]
    return PipelineStage(stage, chunks, stage.index == plan.num_stages - 1, modules)


def _check_units_cover_trainable(model: MultimodalModel, specs: Sequence[UnitSpec]) -> None:
    covered = {id(p) for s in specs for m in s.modules for p in model.get_submodule(m).parameters()}
    for name, param in model.named_parameters():
        if param.requires_grad and id(param) not in covered:
            raise ValueError(f"parameter {name!r} trains but belongs to no pipeline unit (unsupported model part)")


class _Reached(Exception):
    """Raised by a probe hook to stop a forward once the first layer's input is seen."""


def _check_inputs_embeds_pass_through(llm: nn.Module) -> None:
    """LLM stages after the first feed received hidden states as ``inputs_embeds``: that is only right when
    the decoder stack hands ``inputs_embeds`` to its first layer unchanged (Granite, for one, scales them)."""
    layout = llm_layout(llm)  # type: ignore[arg-type]
    layers = llm.get_submodule(layout.layers)
    if not len(layers):
        return
    seen: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append(args[0] if args else kwargs["hidden_states"])
        raise _Reached

    param = next(llm.parameters())
    device = next((t.device for t in (*llm.parameters(), *llm.buffers()) if not t.is_meta), None)
    if device is None:  # nothing of the LLM materialised on this rank: no probe possible (nor needed)
        return
    probe = torch.randn(1, 2, llm.get_input_embeddings().embedding_dim, dtype=param.dtype, device=device)
    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            llm.get_submodule(layout.base)(inputs_embeds=probe, use_cache=False)
    except _Reached:
        pass
    finally:
        handle.remove()
    if not seen or not torch.equal(seen[0], probe):
        raise ValueError(
            f"{type(llm).__name__} changes inputs_embeds before its first layer: its decoder cannot be split "
            "into several pipeline stages (use one LLM stage)"
        )


def _tied_embedding(
    model: MultimodalModel, plan: PipelinePlan, pp_rank: int, specs: Sequence[UnitSpec]
) -> TiedEmbedding | None:
    llm = model.language_model
    weight = getattr(llm.get_input_embeddings(), "weight", None)
    if weight is None or weight is not getattr(llm.get_output_embeddings(), "weight", None):
        return None
    kinds = {s.unit.kind: s.unit.name for s in specs if s.unit.module == LLM_MODULE}
    embed_rank = plan.stages[plan.stage_of_unit(kinds["embed"])].rank
    head_rank = plan.stages[plan.stage_of_unit(kinds["head"])].rank
    if embed_rank == head_rank or pp_rank not in (embed_rank, head_rank) or not weight.requires_grad:
        return None
    mirror = pp_rank == head_rank
    return TiedEmbedding(embed_rank if mirror else head_rank, weight, mirror)


def _prune(model: MultimodalModel, specs: Sequence[UnitSpec], owned: set[str]) -> None:
    """Replace every module of a non-owned unit, and every module on no unit's path (pooling heads, an
    unreachable post-norm), by ``nn.Identity``; layer lists keep the owned layers only."""
    on_path = {m for s in specs for m in s.modules}
    llm_layers = f"language_model.{llm_layout(model.language_model).layers}"
    layer_lists: dict[str, list[tuple[int, nn.Module]]] = {llm_layers: []}
    for name, branch in model.encoders.items():
        layout = encoder_layout(branch.encoder)  # type: ignore[arg-type]
        prefix = f"encoders.{name}.encoder."
        layer_lists[prefix + layout.layers] = []
        for path in (*layout.heads, *([layout.post_norm] if layout.post_norm else [])):
            if prefix + path not in on_path:
                model.set_submodule(prefix + path, nn.Identity())
    for spec in specs:
        if spec.unit.name in owned and spec.layer >= 0:
            parent = spec.modules[0].rsplit(".", 1)[0]
            layer_lists[parent].append((spec.layer, model.get_submodule(spec.modules[0])))
        elif spec.unit.name not in owned and spec.layer < 0:
            for path in spec.modules:
                model.set_submodule(path, nn.Identity())
    for parent, layers in layer_lists.items():
        model.set_submodule(parent, OwnedLayers([m for _, m in layers], [i for i, _ in layers]))
