"""Expert parallelism (EP) of mixture-of-experts LLM layers as a cost transform: all-to-all token dispatch and
combine, and the expert load imbalance.

Under EP (GShard, Lepikhin et al., arXiv 2006.16668, section 2.2; Megatron-Core's and torchtitan's MoE layers) the
``ep`` ranks of an EP group (``ParallelDegrees.ep``, taken from the data-parallel ranks of the LLM's stages) each
hold ``E / ep`` of a layer's ``E`` routed experts (contiguous: rank ``r`` holds experts ``r E / ep ..
(r + 1) E / ep - 1``), and every token's hidden state goes to the ranks of its ``k`` chosen experts and back:

- **Memory** (``sharding``): the routed experts' parameters, gradients and optimizer state per rank are divided by
  ``ep`` (``UnitCost.expert_param_bytes``, set by ``analytic.unit_costs`` for MoE layers); under FSDP2 the
  experts are further sharded over the ``dp_shard / ep`` ranks that hold the same experts (torchtitan), so a
  rank holds ``1 / max(ep, dp_shard)`` of them.
- **All-to-all** (:func:`alltoall_s`): per MoE layer and microbatch two all-to-alls in the forward (dispatch to
  the experts, combine back) and two in the backward (their gradients), each moving ``dispatch_bytes x (ep - 1) /
  ep`` off every rank (``dispatch_bytes = tokens x k x H x b``, :attr:`ExpertLayer.dispatch_bytes`: the share of
  the token copies whose expert sits on another rank, uniform routing) on the EP group's link (intra-node when the
  group's ranks sit in one node, ``topology``). A checkpointed layer's recomputed forward repeats its two.
- **Routed-expert time** (:meth:`ExpertLayer.routed_s`): a roofline per pass, ``max(f x compute_s, weights_s /
  ep + f x tokens_s)``: the routed matmuls' FLOPs and token traffic stay those of the rank's tokens, but a rank
  reads only its ``E / ep`` experts' weights (small-batch MoE layers are bound by those reads: EP's gain in time).
  The difference to ``ep = 1`` replaces the routed part of each pass of the layer (forward, dX, dW).
- **Load imbalance** (:func:`imbalance`): the routed work of a microbatch is set by the EP rank with the most routed
  tokens, so its FLOPs and token traffic and the all-to-all bytes are scaled by the layer's rank-level factor
  ``f = max rank load / mean rank load``, computed from the router's measured per-expert token shares
  (``Profile.router_load``) grouped as the ranks hold them. It is 1 for ``ep = 1`` (one rank runs every expert) and
  equals the expert-level factor ``max expert load / mean`` for ``ep = E``. **Default: uniform routing**, factor
  1.0, when no distribution was measured.

Not modelled: the all-to-all's wait on the slowest rank beyond its bytes, capacity factors and token dropping
(dropless routing is assumed), shared experts (``arch`` refuses them), the dispatch buffers' memory, and the expert
gradients' all-reduce over the ``dp / ep`` ranks holding the same experts (charged, with the rest, over all ``dp``:
an upper bound). Pure: no torch, no processes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plait.planner.cost.arch import DecoderArch, split_model_configs
from plait.planner.cost.types import DeviceSpec, MicrobatchShape, dtype_bytes
from plait.planner.pipeline.types import P2PModel
from plait.planner.serialize import JsonDataclass
from plait.planner.types import LLM_MODULE, Unit, UnitCost

__all__ = ["ALLTOALLS_BACKWARD", "ALLTOALLS_FORWARD", "ExpertDispatch", "ExpertLayer", "alltoall_s",
           "expert_layers", "expert_parallel_costs", "imbalance", "searched_ep_degrees"]

ALLTOALLS_FORWARD = 2
"""All-to-alls per MoE layer in a forward: dispatch and combine."""
ALLTOALLS_BACKWARD = 2
"""All-to-alls per MoE layer in a backward: the gradients of dispatch and combine."""


@dataclass(frozen=True)
class ExpertLayer(JsonDataclass):
    """The routed experts of one MoE layer unit for one microbatch (module docstring).

    Attributes:
        unit: the layer unit's name (``Unit.name``).
        experts: routed experts ``E`` of the layer.
        dispatch_bytes: bytes of the token copies routed to experts: ``tokens x k x H x b``.
        compute_s: seconds of the routed experts' matmul FLOPs of one pass (forward, dX or dW alike) at the
            device's sustained peak, for the microbatch's tokens.
        weights_s: seconds to read all ``E`` experts' weights from device memory (once per pass).
        tokens_s: seconds of the routed tokens' traffic through device memory per pass.
        load: per expert its share of the layer's routed tokens (measured, ``Profile.router_load``), ``()``:
            uniform.

    Raises:
        ValueError: on fewer than one expert, negative bytes or times, or a ``load`` whose length is not
            ``experts``, with a negative share or summing to 0 (naming the unit).
    """

    unit: str
    experts: int
    dispatch_bytes: float
    compute_s: float = 0.0
    weights_s: float = 0.0
    tokens_s: float = 0.0
    load: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "load", tuple(float(x) for x in self.load))
        if self.experts < 1:
            raise ValueError(f"ExpertLayer {self.unit!r}: experts must be >= 1, got {self.experts}")
        for name in ("dispatch_bytes", "compute_s", "weights_s", "tokens_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"ExpertLayer {self.unit!r}: {name} must be >= 0, got {getattr(self, name)}")
        if self.load:
            if len(self.load) != self.experts:
                raise ValueError(f"ExpertLayer {self.unit!r}: load has {len(self.load)} shares for "
                                 f"{self.experts} experts")
            if min(self.load) < 0 or not math.fsum(self.load) > 0:
                raise ValueError(f"ExpertLayer {self.unit!r}: load shares must be >= 0 and not all 0")

    def imbalance(self, ep: int) -> float:
        """This layer's rank-level load factor at EP degree ``ep`` (:func:`imbalance`)."""
        return imbalance(self.load, ep, self.unit)

    def routed_s(self, ep: int) -> float:
        """Seconds of one pass of the routed experts on the busiest of ``ep`` ranks (module docstring):
        ``max(f x compute_s, weights_s / ep + f x tokens_s)``, ``f`` = :meth:`imbalance` at ``ep``.

        Raises:
            ValueError: as :func:`imbalance`."""
        f = self.imbalance(ep)
        return max(f * self.compute_s, self.weights_s / ep + f * self.tokens_s)


@dataclass(frozen=True)
class ExpertDispatch(JsonDataclass):
    """What EP adds to the MoE layers' times under one plan: the layers and the link of their EP group.

    Attributes:
        layers: one :class:`ExpertLayer` per MoE layer unit.
        link: the link the EP group's all-to-alls use (None: free).
    """

    layers: tuple[ExpertLayer, ...] = ()
    link: P2PModel | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))


def imbalance(load: Sequence[float], ep: int, unit: str = "layer") -> float:
    """``max rank load / mean rank load`` of a layer whose experts' token shares are ``load`` when ``ep`` ranks
    hold ``len(load) / ep`` contiguous experts each (module docstring): ``ep x max over ranks of the rank's summed
    share`` over the total; 1.0 for uniform routing (``load`` empty) or ``ep = 1``.

    Raises:
        ValueError: when ``ep`` is below 1 or does not divide the expert count (naming ``unit``).
    """
    if ep < 1:
        raise ValueError(f"{unit}: EP degree must be >= 1, got {ep}")
    if not load or ep == 1:
        return 1.0
    if len(load) % ep:
        raise ValueError(f"{unit}: EP degree {ep} does not divide its {len(load)} experts")
    per = len(load) // ep
    total = math.fsum(load)
    return ep * max(math.fsum(load[r * per:(r + 1) * per]) for r in range(ep)) / total


def alltoall_s(num_bytes: float, ep: int, link: P2PModel | None) -> float:
    """Seconds of one all-to-all in which every one of ``ep`` ranks holds ``num_bytes`` bound evenly for all ranks:
    ``(ep - 1)`` messages of latency plus ``(ep - 1) / ep x num_bytes / bandwidth`` (the pairwise exchange; the
    bytes to itself stay local). 0 for ``ep == 1`` or no link."""
    if link is None or ep <= 1:
        return 0.0
    volume = (ep - 1) / ep * num_bytes
    return (ep - 1) * link.latency_s + (volume / link.bandwidth_Bps if link.bandwidth_Bps else 0.0)


def expert_parallel_costs(units: Sequence[Unit], costs: Sequence[UnitCost], ep: int,
                          dispatch: ExpertDispatch | None) -> list[UnitCost]:
    """Per-rank times of ``units`` under EP degree ``ep`` (module docstring): each pass (forward, dX, dW) of a MoE
    layer has its routed part replaced, ``ExpertLayer.routed_s(ep) - routed_s(1)`` added (at least 0 left); its
    forward gains :data:`ALLTOALLS_FORWARD` all-to-alls of ``f x dispatch_bytes`` (``f``: the layer's
    :func:`imbalance` at ``ep``), and its backward :data:`ALLTOALLS_BACKWARD` more, on its dX (on its dW, over its
    trained share, when it needs no input gradient). Memory is ``sharding``'s (``UnitCost.expert_param_bytes``).
    Unchanged for ``ep == 1`` or without ``dispatch``.

    Raises:
        ValueError: on mismatched lengths, an ``ExpertLayer`` naming no unit, or an ``ep`` that does not divide a
            layer's experts.
    """
    if len(units) != len(costs):
        raise ValueError(f"{len(units)} units but {len(costs)} costs")
    if ep == 1 or dispatch is None or not dispatch.layers:
        return list(costs)
    by_name = {layer.unit: layer for layer in dispatch.layers}
    missing = set(by_name) - {u.name for u in units}
    if missing:
        raise ValueError(f"expert layers name no unit: {sorted(missing)[:3]}")
    out = []
    for unit, cost in zip(units, costs):
        layer = by_name.get(unit.name)
        if layer is None:
            out.append(cost)
            continue
        if layer.experts % ep:
            raise ValueError(f"{unit.name}: EP degree {ep} does not divide its {layer.experts} experts")
        a2a = alltoall_s(layer.imbalance(ep) * layer.dispatch_bytes, ep, dispatch.link)
        delta = layer.routed_s(ep) - layer.routed_s(1)
        forward = max(0.0, cost.forward_s + delta) + ALLTOALLS_FORWARD * a2a
        dx = max(0.0, cost.input_grad_s + delta) if cost.input_grad_s else 0.0
        dw = max(0.0, cost.weight_grad_s + delta)
        back = ALLTOALLS_BACKWARD * a2a if unit.needs_input_grad else 0.0
        if unit.needs_input_grad:
            dx += back
        elif unit.trainable:
            dw += ALLTOALLS_BACKWARD * a2a / unit.trained_fraction
        split = cost.split_mapped(lambda b: max(0.0, b + delta) + back, lambda w: max(0.0, w + delta))
        out.append(dataclasses.replace(cost, forward_s=forward, input_grad_s=dx, weight_grad_s=dw, **split))
    return out


def expert_layers(units: Sequence[Unit], model_configs: Mapping[str, Any], shape: MicrobatchShape,
                  device: DeviceSpec, dtype: Any = "bfloat16",
                  router_load: Mapping[str, Sequence[float]] | None = None) -> tuple[ExpertLayer, ...]:
    """One :class:`ExpertLayer` per MoE layer unit of the LLM (``model_configs["llm"]`` with ``num_experts``), for
    a microbatch of ``shape.tokens`` LLM tokens: ``dispatch_bytes = T k H b``; on ``device`` (``analytic``'s
    roofline terms, the same for forward, dX and dW: weight matmuls only) ``compute_s`` of ``2 T k 3 H I_e`` FLOPs,
    ``weights_s`` of the ``E 3 H I_e b`` expert weight bytes and ``tokens_s`` of ``T k (2 H + 6 I_e) b`` bytes
    moved; ``router_load``: per unit name the measured per-expert token shares (``Profile.router_load``; missing:
    uniform).

    Raises:
        ValueError: on a ``router_load`` entry naming no MoE layer unit, or a bad load (``ExpertLayer``).
    """
    archs, _ = split_model_configs(model_configs)
    arch = archs.get(LLM_MODULE)
    loads = dict(router_load or {})
    if not isinstance(arch, DecoderArch) or not arch.num_experts:
        if loads:
            raise ValueError(f"router_load names {sorted(loads)[:3]} but the LLM has no experts")
        return ()
    b = dtype_bytes(dtype)
    t, h, k, inter = shape.tokens, arch.hidden, arch.experts_per_token, arch.expert_intermediate
    compute = device.compute_time(2.0 * t * k * 3 * h * inter, 0.0)
    weights = device.compute_time(0.0, arch.num_experts * 3 * h * inter * b)
    tokens = device.compute_time(0.0, t * k * (2 * h + 6 * inter) * b)
    names = [u.name for u in units if u.module == LLM_MODULE and u.kind == "layer"]
    unknown = set(loads) - set(names)
    if unknown:
        raise ValueError(f"router_load names unit(s) that are not MoE layers: {sorted(unknown)[:3]}")
    return tuple(ExpertLayer(name, arch.num_experts, t * k * h * b, compute, weights, tokens,
                             tuple(loads.get(name, ()))) for name in names)


def searched_ep_degrees(given: Sequence[int] | None, layers: Sequence[ExpertLayer], devices: int) -> tuple[int, ...]:
    """The EP degrees a search on ``devices`` devices considers: ``given`` (``SearchSpace.ep_degrees``), else the
    powers of two up to ``devices`` dividing every MoE layer's experts (just 1 without MoE layers).

    Raises:
        ValueError: on an EP degree above 1 without MoE layers, or one not dividing a layer's experts.
    """
    counts = {layer.experts for layer in layers}
    if given is None:
        powers = [1 << k for k in range(max(devices, 1).bit_length())]
        return tuple(e for e in powers if all(c % e == 0 for c in counts)) if counts else (1,)
    bad = [e for e in given if e > 1 and (not counts or any(c % e for c in counts))]
    if bad:
        raise ValueError(f"ep_degrees {bad}: " + (f"must divide the experts per layer {sorted(counts)}" if counts
                                                   else "EP needs the MoE layers (plan_parallel's experts)"))
    return tuple(given)
