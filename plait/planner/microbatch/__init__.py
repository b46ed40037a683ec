"""Workload-balanced microbatch assignment: which DP rank and which microbatch runs each sample.

A multimodal sample costs differently in every module: a 4-megapixel image is heavy for the vision
encoder, a 30 s clip for the audio encoder, a long conversation for the LLM, and a text-only sample costs
nothing in any encoder. When the samples of a global batch are cut into microbatches in arrival order, the
per-microbatch work of every module swings widely, and since each pipeline stage runs one module's layers,
the slowest stage of every microbatch sets the pace (bubbles) and the slowest DP replica sets the step time
(stragglers). This planner assigns the samples of one global batch to DP replicas and, inside a replica,
to ``M`` microbatches so that every module sees steady work.

The package: ``types`` (the inputs ``ModuleCostCoeffs``, ``SampleCost``, ``MicrobatchPolicy`` and the output
``MicrobatchPlan``), ``metadata`` (``SampleCost`` from the loader's per-sample metadata), ``plan``
(``plan_microbatches`` and the baselines), ``hierarchical`` (the balancing method, levels 0-2),
``partition`` (the vector partition both levels use), ``stats`` (``workload_stats``, the balance metric).

Empty microbatches: with fewer samples than ``dp * num_microbatches`` (or when a balanced plan needs it),
some microbatches are empty tuples. The runtime must still run the iteration's schedule for them as
no-ops (every stage of the replica reads the same plan, so they skip the same slots) and the replica still
joins the gradient all-reduce. Because the loss of a global batch is the sum of token cross-entropies
divided by the number of target tokens of the *whole* global batch, an empty microbatch contributes exactly
zero loss and zero gradient, and neither the
grouping nor unequal sample counts per rank change the gradient. With deferral a microbatch can also be
empty for the encoders only (its LLM samples are text-only or come from buffers) or for the LLM only (all
its samples deferred): the runtime reads the encoder view (``microbatches``) and the LLM view
(``MicrobatchPlan.llm_microbatches``) separately.

Module order: ``SampleCost.work`` holds one entry per module; the encoders come first in a fixed order and
the LLM is always the **last** entry (``sample_costs_from_metadata`` builds them that way and
``module_order`` names them).
"""

from plait.planner.microbatch.metadata import module_order, sample_costs_from_metadata
from plait.planner.microbatch.plan import plan_microbatches
from plait.planner.microbatch.stats import workload_stats
from plait.planner.microbatch.types import (
    METHODS, MicrobatchPlan, MicrobatchPolicy, ModuleCostCoeffs, SampleCost, WorkloadStats,
)

__all__ = [
    "METHODS",
    "MicrobatchPlan",
    "MicrobatchPolicy",
    "ModuleCostCoeffs",
    "SampleCost",
    "WorkloadStats",
    "module_order",
    "plan_microbatches",
    "sample_costs_from_metadata",
    "workload_stats",
]
