"""Expert parallelism with context parallelism (``parallel.ep = 2`` x ``parallel.cp = 2``, 4 gloo processes) equals
one process on the same global batches: the tiny MoE MLLM (frozen SigLIP encoder, trained projector, Qwen3-MoE LLM
with 4 experts, top-2), plait's attention in both; losses (rel 1e-5), first-step gradients (rel 1e-5 of each
gradient's scale) and final parameters after 2 AdamW steps (rtol 1e-5 / atol 1e-6; ``assert_same_training``). Each
CP rank routes its share of the tokens over the EP group of its CP index; the expert gradients are summed over the
CP ranks and the expert-data-parallel ranks."""

from __future__ import annotations

from plait.parallel.dims import ParallelDims
from tests.distributed.spawning import shared_reference
from tests.helpers.moe import WORKER, assert_equal_runs
from tests.helpers.fsdp import run
from tests.helpers.moe import moe_job

ATTENTION = {"implementation": "plait", "block_size": 8}


def single_run(tmp_path) -> dict:
    """The one-process run both EP x CP layouts are compared with: trained once per session (``shared_reference``;
    only its returned losses, gradients and parameters are read)."""
    cfg = moe_job(tmp_path) | {"attention": ATTENTION}
    return shared_reference(str(WORKER), cfg, lambda: run(cfg, tmp_path, "single", 1, WORKER))


def test_expert_groups_under_cp_span_the_cp_axis_for_gradients():
    dims = ParallelDims(dp=2, cp=2, ep=2)  # rank = dp * 2 + cp
    ep_groups, replicas = dims.expert_groups()
    assert ep_groups == [[0, 2], [1, 3]]  # one CP index, both batch ranks
    assert replicas == [[0, 1], [2, 3]]  # the CP ranks of one batch rank hold the same experts
    assert ParallelDims(dp=4, cp=2, ep=2).expert_groups()[1] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_ep2_with_cp2_equals_one_process(tmp_path):
    single = single_run(tmp_path)
    ep_cp = run(moe_job(tmp_path, ep=2, cp=2) | {"attention": ATTENTION}, tmp_path, "ep_cp", 4, WORKER)
    assert ep_cp["world"] == 4 and ep_cp["local"] == [[(2, 32, 32)] * 2] * 4  # E/ep experts on every rank
    assert_equal_runs(single, ep_cp)


def test_ep2_with_cp2_and_fsdp2_equals_one_process(tmp_path):
    """``dp_shard = 2`` x ``cp = 2``: FSDP2 of the other parameters, their gradients summed over CP too."""
    single = single_run(tmp_path)
    both = run(moe_job(tmp_path, ep=2, cp=2, dp_shard=2) | {"attention": ATTENTION}, tmp_path, "ep_cp_fsdp", 4,
               WORKER)
    assert both["sharded"] and both["local"] == [[(2, 32, 32)] * 2] * 4
    assert_equal_runs(single, both)
