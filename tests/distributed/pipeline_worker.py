"""Pipeline test cases: a tiny composite, synthetic microbatches, and the per-rank check that a pipeline step
equals one process training the same global batches (spawned by tests/distributed/test_pipeline.py, and with
context parallelism by tests/distributed/test_pipeline_cp.py; the model and batch builders are shared with
tests/unit/parallel/test_stages.py)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from plait.attention.interface import use_plait_attention
from plait.attention.masks import MaskInfo, block_work
from plait.data.collate import Batch
from plait.models.encoder import ModalityEncoder
from plait.models.hf import build_causal_lm, build_encoder
from plait.models.multimodal import MultimodalModel
from plait.models.projector import build_projector
from plait.models.units import model_units
from plait.parallel.context import build_cp_shard
from plait.parallel.pipeline import (
    build_pipeline_comm,
    clip_grad_norm_pipeline,
    gather_timeline,
    pipeline_comm_from_mesh,
    run_pipeline_step,
)
from plait.parallel.pipeline.encoder_tp import apply_encoder_tensor_parallel
from plait.parallel.stages import build_rank_stages
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.schedules import build_schedule
from plait.planner.token_distributor import TokenAssignment, plan_tokens
from plait.train.loss import token_loss_sum
from tests.helpers.jobs import TINY_AUDIO, TINY_LLM, TINY_VISION
from tests.distributed.spawning import gloo_group

VOCAB = 50
IMG, AUD = 48, 49
RTOL = 1e-5


def tiny_model(tied: bool = False, seed: int = 0, feature_layer: int = -1) -> MultimodalModel:
    """SigLIP (MLP projector) + Whisper (linear projector, pooling 4) + 2-layer Llama, fp32, no dropout."""
    torch.manual_seed(seed)
    llm = build_causal_lm(config=dict(TINY_LLM, tie_word_embeddings=tied), vocab_size=VOCAB,
                          attn_implementation="eager")
    vis = ModalityEncoder(build_encoder("image", config=TINY_VISION), build_projector("mlp", 32, 32), "image",
                          feature_layer)
    aud = ModalityEncoder(build_encoder("audio", config=TINY_AUDIO), build_projector("linear", 32, 32), "audio",
                          feature_layer, downsample=4)
    return MultimodalModel(llm, {"vision": vis, "audio": aud}, {"vision": IMG, "audio": AUD})


def apply_mode(model: MultimodalModel, mode: str) -> MultimodalModel:
    """``all``: everything trains; ``projectors``: frozen encoders and LLM, trainable projectors;
    ``llm``: frozen encoders and projectors, trainable LLM; ``vision``: only the vision branch trains."""
    model.set_frozen("encoder", mode not in ("all", "vision"))
    model.set_frozen("projector", mode == "llm")
    model.set_frozen("llm", mode in ("projectors", "vision"))
    if mode == "vision":
        model.set_frozen("encoder", True, "audio")
        model.set_frozen("projector", True, "audio")
    return model


def make_batch(kind: str, seed: int) -> Batch:
    """Two rows; ``kind`` holds ``i`` (a 16x16 and a 24x32 image), ``a`` (a 0.5 s clip) or is ``t`` (text only)."""
    g = torch.Generator().manual_seed(seed)
    n_img, n_aud = (4, 12) if "i" in kind else (0, 0), 7 if "a" in kind else 0
    width = max(n_img[0] + 6, n_img[1] + n_aud + 4, 9)
    ids = torch.randint(1, 40, (2, width), generator=g)
    inputs: dict = {}
    if "i" in kind:
        ids[0, 1 : 1 + n_img[0]] = IMG
        ids[1, 0 : n_img[1]] = IMG
        inputs["vision"] = {"pixel_values": [torch.randn(3, 16, 16, generator=g), torch.randn(3, 24, 32, generator=g)]}
    if "a" in kind:
        ids[1, n_img[1] + 1 : n_img[1] + 1 + n_aud] = AUD
        inputs["audio"] = {"input_features": torch.randn(1, 80, 300, generator=g), "num_samples": torch.tensor([8000])}
    labels = torch.roll(ids, -1, 1)
    labels[(labels == IMG) | (labels == AUD)] = -100
    labels[:, -1] = -100
    attn = torch.ones_like(ids)
    attn[0, -2:] = 0  # row 0 is padded
    labels[0, -3:] = -100
    pos = torch.arange(width).expand(2, -1).clone()
    zeros = torch.zeros_like(ids)
    return Batch(ids, labels, attn, pos, zeros, zeros - 1, inputs, ())


def reference_step(model: MultimodalModel, batches: list[Batch]) -> float:
    """One process: every microbatch's loss sum / global target tokens, backward; returns the global loss."""
    targets = sum(b.target_tokens for b in batches)
    total = 0.0
    for b in batches:
        loss = token_loss_sum(model(b.input_ids, b.modality_inputs, b.attention_mask, b.position_ids), b.labels)
        if loss.requires_grad:  # a text-only microbatch under a frozen LLM has nothing to train
            (loss / targets).backward()
        total += float(loss.detach())
    return total / targets


@dataclass(frozen=True)
class Case:
    """One pipeline configuration run for ``len(steps)`` optimizer steps; ``steps[k]`` lists the kinds of the
    global batch's microbatches (``M * dp`` of them; DP replica ``d`` takes the ``d``-th run of ``M``)."""

    name: str
    layout: str
    stages_per_module: dict
    ranks: tuple[int, ...]
    schedule: str
    mode: str
    steps: tuple[tuple[str, ...], ...]
    tied: bool = False
    clip: float = 0.0
    options: dict = field(default_factory=dict)
    instrument: bool = False
    replicas: dict = field(default_factory=dict)  # encoder branch -> its replicated stages (plan_pipeline)
    tensor_parallel: dict = field(default_factory=dict)  # encoder branch -> its stages' TP degree (plan_pipeline)


ENC_PAR = dict(layout="encoder_parallel", stages_per_module={"vision": 2, "audio": 1, "llm": 2}, ranks=(0, 1, 0, 1, 0))
COLOC = dict(layout="encoders_colocated", stages_per_module={"vision": 2, "audio": 2, "llm": 2}, ranks=(0, 1, 0, 1))
V_ATTACHED = dict(layout="encoder_parallel", stages_per_module={"vision": 2, "audio": 1, "llm": 4},
                  ranks=(0, 0, 0, 0, 1, 1, 0))
V_OWN = dict(layout="encoder_parallel", stages_per_module={"vision": 1, "audio": 1, "llm": 4}, ranks=(0, 1, 2, 3, 3, 2))
# encoders in the LLM's bubbles (stage_ranks(..., in_bubble=True)): each encoder a stage on an LLM rank from the last
IN_BUBBLE_2 = dict(layout="encoder_parallel", stages_per_module={"vision": 1, "audio": 1, "llm": 2}, ranks=(1, 0, 0, 1))
IN_BUBBLE_4 = dict(layout="encoder_parallel", stages_per_module={"vision": 1, "audio": 1, "llm": 4},
                   ranks=(3, 2, 0, 1, 2, 3))
STEPS = (("iva", "t"), ("a", "t"), ("i", "ia"))  # step 2 has no image at all

CASES_2 = (
    Case("encpar-gpipe-all-text-between-images", **ENC_PAR, schedule="gpipe", mode="all",
         steps=(("i", "t", "i"), ("a", "t", "t"), ("iva", "t", "i"))),
    Case("encpar-1f1b-all-tied-clip", **ENC_PAR, schedule="1f1b", mode="all", steps=STEPS, tied=True, clip=0.5),
    Case("encpar-1f1b-projectors", **ENC_PAR, schedule="1f1b", mode="projectors", steps=STEPS, instrument=True),
    Case("encpar-gpipe-llm", **ENC_PAR, schedule="gpipe", mode="llm", steps=STEPS, instrument=True),
    Case("coloc-gpipe-all", **COLOC, schedule="gpipe", mode="all", steps=STEPS),
    Case("coloc-1f1b-all-split-backward", **COLOC, schedule="1f1b", mode="all", steps=STEPS,
         options={"split_backward": True, "defer_weight_grad": True}),
    Case("coloc-1f1b-projectors", **COLOC, schedule="1f1b", mode="projectors", steps=STEPS, instrument=True),
    Case("coloc-gpipe-llm-tied", **COLOC, schedule="gpipe", mode="llm", steps=STEPS, tied=True),
    # zero-bubble: W from the gradients B kept; frozen stages have no W
    Case("encpar-zbh1-projectors", **ENC_PAR, schedule="zb_h1", mode="projectors", steps=STEPS, instrument=True),
    Case("encpar-zbh2-all-tied-clip", **ENC_PAR, schedule="zb_h2", mode="all", steps=STEPS, tied=True, clip=0.5),
    Case("coloc-zbh1-llm", **COLOC, schedule="zb_h1", mode="llm", steps=STEPS),
    # ZB-V: the LLM's 4 stages in a V (rank 0 holds the first and the last), the encoders on the first LLM rank
    Case("vshape-zbv-projectors", **V_ATTACHED, schedule="zb_v", mode="projectors", steps=STEPS, instrument=True),
    Case("vshape-zbv-all-tied-clip", **V_ATTACHED, schedule="zb_v", mode="all", steps=STEPS, tied=True, clip=0.5),
    # encoders in the bubbles: two encoder stages (vision on LLM rank 1, audio on rank 0), or one colocated on rank 1
    Case("inbubble-1f1b-all-tied-clip", **IN_BUBBLE_2, schedule="1f1b", mode="all", steps=STEPS, tied=True, clip=0.5),
    Case("inbubble-zbh1-projectors", **IN_BUBBLE_2, schedule="zb_h1", mode="projectors", steps=STEPS, instrument=True),
    Case("inbubble-coloc-1f1b-projectors", layout="encoders_colocated", stages_per_module={"vision": 1, "audio": 1,
         "llm": 2}, ranks=(1, 0, 1), schedule="1f1b", mode="projectors", steps=STEPS, instrument=True),
)
CASES_4 = (
    # PP 2 x DP 2: replica 1 gets no image in any step; embeddings tied across pipeline ranks
    Case("pp2xdp2-1f1b-all-tied", **ENC_PAR, schedule="1f1b", mode="all",
         steps=(("iva", "i", "a", "t"), ("t", "i", "ia", "a"), ("a", "t", "i", "iva")), tied=True, clip=0.5),
    Case("pp4-1f1b-projectors", layout="encoder_parallel", stages_per_module={"vision": 2, "audio": 1, "llm": 2},
         ranks=(0, 1, 2, 3, 3), schedule="1f1b", mode="projectors", steps=STEPS, instrument=True),
    Case("pp4-zbh1-all", layout="encoder_parallel", stages_per_module={"vision": 2, "audio": 1, "llm": 2},
         ranks=(0, 1, 2, 3, 3), schedule="zb_h1", mode="all", steps=STEPS),
    Case("pp4-zbh2-projectors", layout="encoder_parallel", stages_per_module={"vision": 2, "audio": 1, "llm": 2},
         ranks=(0, 1, 2, 3, 3), schedule="zb_h2", mode="projectors", steps=STEPS, instrument=True),
    # ZB-V on PP 4: each encoder on its own rank, the LLM's 4 stages in a V over ranks 2 and 3
    Case("pp4-zbv-all-tied", **V_OWN, schedule="zb_v", mode="all", steps=STEPS, tied=True, clip=0.5),
    Case("pp4-zbv-projectors", **V_OWN, schedule="zb_v", mode="projectors", steps=STEPS, instrument=True),
    # encoders in the bubbles of PP 4: vision on LLM rank 3, audio on rank 2; or both in one stage on rank 3
    Case("pp4-inbubble-zbh1-all", **IN_BUBBLE_4, schedule="zb_h1", mode="all", steps=STEPS),
    Case("pp4-inbubble-coloc-1f1b-projectors", layout="encoders_colocated", stages_per_module={"vision": 1,
         "audio": 1, "llm": 4}, ranks=(3, 0, 1, 2, 3), schedule="1f1b", mode="projectors", steps=STEPS,
         instrument=True),
)


# the vision branch on replicated stages (its own data-parallel degree 2): each replica encodes half the images
CASES_REPLICAS = (
    # own ranks 0 and 1 feed a 2-stage LLM on ranks 2 and 3 (audio beside the first LLM stage), all trainable
    Case("replicas-own-1f1b-all-clip", layout="encoder_parallel", stages_per_module={"vision": 1, "audio": 1, "llm": 2},
         ranks=(0, 1, 2, 2, 3), replicas={"vision": 2}, schedule="1f1b", mode="all", steps=STEPS, clip=0.5),
    # a 2-stage vision branch (replica k feeds replica k), zero-bubble split backward
    Case("replicas-chain-zbh1-all", layout="encoder_parallel", stages_per_module={"vision": 2, "audio": 1, "llm": 2},
         ranks=(0, 1, 0, 1, 2, 2, 3), replicas={"vision": 2}, schedule="zb_h1", mode="all", steps=STEPS),
    # frozen towers, trainable projectors, frozen LLM
    Case("replicas-own-gpipe-projectors", layout="encoder_parallel", stages_per_module={"vision": 1, "audio": 1,
         "llm": 2}, ranks=(0, 1, 2, 2, 3), replicas={"vision": 2}, schedule="gpipe", mode="projectors", steps=STEPS,
         instrument=True),
    # the replicas share ranks with the LLM stages (in the bubbles of PP 2, stage_ranks(..., in_bubble=True)), DP 2
    Case("replicas-inbubble-pp2xdp2-1f1b-all-tied-clip", layout="encoder_parallel",
         stages_per_module={"vision": 1, "audio": 1, "llm": 2}, ranks=(1, 0, 1, 0, 1), replicas={"vision": 2},
         schedule="1f1b", mode="all", steps=(("iva", "i", "a", "t"), ("t", "i", "ia", "a"), ("i", "t", "i", "iva")),
         tied=True, clip=0.5),
    # vision's stage as a TP group of 2 on ranks 0 and 1 (weights split by SigLIP's TP plan, every image on both)
    Case("tp-own-1f1b-all-clip", layout="encoder_parallel", stages_per_module={"vision": 1, "audio": 1, "llm": 2},
         ranks=(0, 1, 2, 2, 3), tensor_parallel={"vision": 2}, schedule="1f1b", mode="all", steps=STEPS, clip=0.5),
    # frozen tower, trainable (split) MLP projector, frozen LLM
    Case("tp-own-gpipe-projectors", layout="encoder_parallel", stages_per_module={"vision": 1, "audio": 1, "llm": 2},
         ranks=(0, 1, 2, 2, 3), tensor_parallel={"vision": 2}, schedule="gpipe", mode="projectors", steps=STEPS,
         clip=0.5, instrument=True),
)


def replica_worker(rank: int, world: int, port: int) -> None:
    """Entry point of one spawned process: every case of :data:`CASES_REPLICAS` (4 processes)."""
    with gloo_group(rank, world, port):
        for case in CASES_REPLICAS:
            run_case(case, world)


def _close(actual: float, expected: float, what: str) -> None:
    if abs(actual - expected) > RTOL * abs(expected) + 1e-9:
        raise AssertionError(f"{what}: {actual!r} != {expected!r}")


def _check_grads(stages, ref: MultimodalModel, where: str) -> list[str]:
    """Every trainable parameter this rank owns has the reference gradient (None where the reference has None).

    A gradient that is zero up to rounding in the reference (below 1e-7 of the largest reference gradient,
    e.g. attention key biases: softmax is shift-invariant) only has to be as small in the pipeline.
    """
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    largest = max(float(p.grad.abs().max()) for p in ref_params.values() if p.grad is not None)
    names = []
    for name, param in stages.trainable_parameters():
        expected = ref_params[name].grad
        if expected is None or param.grad is None:
            if not (expected is None and param.grad is None):
                raise AssertionError(f"{where}: {name} grad None mismatch (pipeline {param.grad is None})")
            continue
        scale = float(expected.abs().max())
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad  # a TP encoder's shard
        if scale < 1e-7 * largest:
            assert float(grad.abs().max()) < 1e-6 * largest, f"{where}: {name} should be ~0"
        else:
            torch.testing.assert_close(grad, expected, rtol=RTOL, atol=RTOL * scale,
                                       msg=lambda text: f"{where}: {name}\n{text}")
        names.append(name)
    return names


def run_case(case: Case, world: int) -> None:
    """Train ``case`` on this rank and on a private single-process reference, checking every step."""
    pp = 1 + max(case.ranks)
    comm = build_pipeline_comm(pp)
    if comm.dp_size > 1:  # the same coordinates from a ("dp", "pp") DeviceMesh
        mesh = init_device_mesh("cpu", (comm.dp_size, pp), mesh_dim_names=("dp", "pp"))
        comm = pipeline_comm_from_mesh(mesh)
        assert (comm.pp_rank, comm.dp_rank) == (dist.get_rank() % pp, dist.get_rank() // pp)
        assert comm.pp_ranks == tuple(comm.dp_rank * pp + q for q in range(pp)), comm.pp_ranks
    model = apply_mode(tiny_model(case.tied), case.mode)
    ref = copy.deepcopy(model)
    plan = plan_pipeline(model_units(model), case.layout, stages_per_module=case.stages_per_module, ranks=case.ranks,
                         replicas=case.replicas, tensor_parallel=case.tensor_parallel)
    stages = build_rank_stages(model, plan, comm.pp_rank)
    applied = apply_encoder_tensor_parallel(stages, comm)
    assert bool(applied) == any(plan.stages[s].tensor_parallel for s in stages.stages), applied
    m = len(case.steps[0]) // comm.dp_size
    schedule = build_schedule(plan, case.schedule, m, **case.options)
    params = [p for _, p in stages.trainable_parameters()]
    # a TP encoder sums its row-split products in another order: SGD there, for the reason run_cp_case gives
    make = (lambda ps: torch.optim.SGD(ps, lr=0.5)) if case.tensor_parallel else (
        lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    opt = make(params) if params else None
    ref_opt = make([p for _, p in ref.trainable_parameters()])
    covered: set[str] = set()
    needed: set[str] = set()
    for step, kinds in enumerate(case.steps):
        where = f"{case.name} step {step} rank {dist.get_rank()}"
        batches = [make_batch(k, 100 * step + i) for i, k in enumerate(kinds)]
        mine = batches[comm.dp_rank * m : (comm.dp_rank + 1) * m]
        targets = sum(b.target_tokens for b in batches)
        res = run_pipeline_step(stages, schedule, mine, targets, comm, instrument=case.instrument,
                                loss_fn=token_loss_sum)
        _close(res.loss, reference_step(ref, batches), f"{where}: loss")
        covered.update(_check_grads(stages, ref, where))
        timeline = gather_timeline(res.events, comm)
        expected_events = sum(len(a) for a in schedule.actions) if dist.get_rank() == 0 else 0
        assert len(timeline) == expected_events and all(e.end_s >= e.start_s for e in timeline), where
        needed.update(n for n, p in ref.trainable_parameters() if p.grad is not None)
        _check_clip_and_step(stages, ref, res, case, comm, (opt, ref_opt), where)
    _check_coverage(covered, needed, case.name)


def _check_clip_and_step(stages, ref, res, case, comm, optimizers, where: str) -> None:
    """After one checked step: the frozen-stage instrumentation (``case.instrument``), the clipped pipeline
    gradient norm against the reference's (``case.clip``), then both optimizers step."""
    if case.instrument:
        _check_frozen(stages, res, where)
    if case.clip:
        ref_norm = float(torch.nn.utils.clip_grad_norm_([p for _, p in ref.trainable_parameters()], case.clip))
        _close(clip_grad_norm_pipeline(stages, case.clip, comm), ref_norm, f"{where}: gradient norm")
        _check_grads(stages, ref, where + " after clipping")
    for o in optimizers:
        if o is not None:
            o.step()
            o.zero_grad(set_to_none=True)


def _check_frozen(stages, res, where: str) -> None:
    """Forward-only stages saved nothing and ran no backward; frozen stages that pass gradients computed
    input gradients only (their parameters neither train nor hold a gradient)."""
    for index, stage in stages.stages.items():
        flags = stage.stage
        if not flags.runs_backward:
            assert res.saved_tensors[index] == 0 and res.backward_actions[index] == 0, f"{where}: stage {index}"
        elif not flags.trainable:
            assert res.saved_tensors[index] > 0, f"{where}: stage {index} kept no activation"
            assert all(not p.requires_grad and p.grad is None for p in stage.params), f"{where}: stage {index}"


def _check_coverage(covered: set[str], needed: set[str], name: str) -> None:
    """Across the pipeline ranks, every parameter that got a reference gradient was compared at least once."""
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, sorted(covered))
    missing = needed - set().union(*map(set, everything))
    if missing:
        raise AssertionError(f"{name}: parameters never compared: {sorted(missing)[:5]}")


def worker(rank: int, world: int, port: int) -> None:
    """Entry point of one spawned process: run every case of this world size."""
    with gloo_group(rank, world, port):
        for case in CASES_2 if world == 2 else CASES_4:
            run_case(case, world)


# ----- pipeline x context parallelism ---------------------------------------------------------------------
CP_BLOCK = 4  # tokens per CP block: rows of 9-23 tokens give 3-12 blocks, so LPT shards differ in size


def with_items(batch: Batch) -> Batch:
    """``batch`` with the metadata of a multimodal mask: document -1 on padding, and per row one item id per run
    of consecutive placeholder tokens (0, 1, ... in row order; -1 on text)."""
    items = torch.full_like(batch.input_ids, -1)
    for row, ids in enumerate(batch.input_ids.tolist()):
        count, prev = -1, None
        for t, tok in enumerate(ids):
            if tok in (IMG, AUD) and batch.attention_mask[row, t]:
                count += int(tok != prev)
                items[row, t] = count
            prev = tok
    docs = torch.where(batch.attention_mask.bool(), 0, -1)
    return Batch(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids, docs, items,
                 batch.modality_inputs, ())


def packed(batch: Batch) -> Batch:
    """The real tokens of ``batch``'s rows packed into one row of documents 0, 1, ... (positions restart per
    document, item ids continue across documents; media inputs keep their row-major order)."""
    batch = with_items(batch)
    keep = batch.attention_mask.bool()
    row = {name: getattr(batch, name)[keep].unsqueeze(0) for name in ("input_ids", "labels", "position_ids")}
    docs = torch.cat([torch.full((int(k.sum()),), d) for d, k in enumerate(keep)]).unsqueeze(0)
    items, offset = batch.item_ids.clone(), 0
    for r in range(items.shape[0]):
        items[r][items[r] >= 0] += offset
        offset = int(items[: r + 1].max()) + 1
    item_row = items[keep].unsqueeze(0)
    return Batch(row["input_ids"], row["labels"], torch.ones_like(docs), row["position_ids"], docs, item_row,
                 batch.modality_inputs, ())


def mask_of(batch: Batch) -> MaskInfo:
    """The multimodal mask (bidirectional items) of ``batch``."""
    return MaskInfo.from_batch(vars(batch), mode="bidirectional_items")


def cp_assignment(batch: Batch, cp: int) -> TokenAssignment:
    """LPT assignment of ``batch``'s tokens to ``cp`` ranks on its row-summed block work (what every rank
    computes from the metadata alone)."""
    n = batch.input_ids.shape[1]
    return plan_tokens(block_work(mask_of(batch), CP_BLOCK), n, cp, method="lpt", block_size=CP_BLOCK)


def reference_cp_step(model: MultimodalModel, batches: list[Batch]) -> float:
    """One process, plait attention with the multimodal mask on whole rows: every microbatch's loss sum /
    global target tokens, backward; returns the global loss."""
    targets = sum(b.target_tokens for b in batches)
    total = 0.0
    for b in batches:
        logits = model(b.input_ids, b.modality_inputs, None, b.position_ids, plait_mask=mask_of(b))
        loss = token_loss_sum(logits, b.labels)
        if loss.requires_grad:
            (loss / targets).backward()
        total += float(loss.detach())
    return total / targets


@dataclass(frozen=True)
class CpCase:
    """A PP x CP configuration (``case``: layout, schedule, mode and steps as in :class:`Case`); ``pack`` packs
    every microbatch's rows into one row; ``mesh`` builds the coordinates from a ``("dp", "pp", "cp")``
    DeviceMesh instead of :func:`build_pipeline_comm`."""

    case: Case
    pack: bool = False
    mesh: bool = False


CP_STEPS = (("iva", "t"), ("ia", "a"))
CASES_PP_CP = (
    # LLM split over both pipeline ranks (local-token hidden states cross ranks), embeddings tied across them
    CpCase(Case("pp2xcp2-encpar-1f1b-all-tied-clip", **ENC_PAR, schedule="1f1b", mode="all", steps=CP_STEPS,
                tied=True, clip=0.5)),
    # frozen encoders and LLM, trainable projectors: the frozen LLM stages pass input gradients through CP
    CpCase(Case("pp2xcp2-encpar-gpipe-projectors", **ENC_PAR, schedule="gpipe", mode="projectors",
                steps=CP_STEPS, instrument=True), mesh=True),
    # packed documents, split backward (B and W both run the K/V reduce-scatter)
    CpCase(Case("pp2xcp2-coloc-1f1b-all-split-backward-packed", **COLOC, schedule="1f1b", mode="all",
                steps=(("iva", "ia"), ("i", "a")), options={"split_backward": True, "defer_weight_grad": True}),
           pack=True),
)


def _cp_comm(pp: int, cp: int, from_mesh: bool):
    """This rank's coordinates, checked against the documented layout rank = (dp * pp + pp_rank) * cp + cp_rank."""
    rank = dist.get_rank()
    if from_mesh:
        mesh = init_device_mesh("cpu", (dist.get_world_size() // (pp * cp), pp, cp), mesh_dim_names=("dp", "pp", "cp"))
        comm = pipeline_comm_from_mesh(mesh)
    else:
        comm = build_pipeline_comm(pp, cp_size=cp)
    dp_rank, rest = divmod(rank, pp * cp)
    assert (comm.dp_rank, comm.pp_rank, comm.cp_rank) == (dp_rank, rest // cp, rest % cp), rank
    assert comm.pp_ranks == tuple((dp_rank * pp + q) * cp + rank % cp for q in range(pp)), comm.pp_ranks
    assert comm.cp_size == cp and dist.get_world_size(comm.cp_group) == cp
    assert dist.get_world_size(comm.reduce_group) == comm.stage_replicas == dist.get_world_size() // pp
    return comm


def run_cp_case(cp_case: CpCase, cp: int) -> bool:
    """Train ``cp_case`` with PP x CP on this rank and on a private single-process reference, checking loss,
    gradients (and the clipped norm) every step. Returns whether some microbatch had uneven CP shards."""
    case = cp_case.case
    pp = 1 + max(case.ranks)
    comm = _cp_comm(pp, cp, cp_case.mesh)
    model = apply_mode(tiny_model(case.tied), case.mode)
    use_plait_attention(model.language_model, "sdpa")
    ref = copy.deepcopy(model)
    plan = plan_pipeline(model_units(model), case.layout, stages_per_module=case.stages_per_module, ranks=case.ranks)
    stages = build_rank_stages(model, plan, comm.pp_rank)
    m = len(case.steps[0]) // comm.dp_size
    schedule = build_schedule(plan, case.schedule, m, **case.options)
    # SGD, not AdamW: CP sums each gradient in another order (per-rank partial sums), and AdamW's division by
    # sqrt(v) turns rounding noise in gradients that are exactly 0 (key biases) into full +-lr steps
    params = [p for _, p in stages.trainable_parameters()]
    opt = torch.optim.SGD(params, lr=0.5) if params else None
    ref_opt = torch.optim.SGD([p for _, p in ref.trainable_parameters()], lr=0.5)
    covered: set[str] = set()
    needed: set[str] = set()
    uneven = False
    for step, kinds in enumerate(case.steps):
        where = f"{case.name} step {step} rank {dist.get_rank()}"
        batches = [with_items(make_batch(k, 100 * step + i)) for i, k in enumerate(kinds)]
        batches = [packed(b) for b in batches] if cp_case.pack else batches
        assignments = {id(b): cp_assignment(b, cp) for b in batches}
        uneven |= any(len(set(a.tokens_per_rank)) > 1 for a in assignments.values())

        def llm_kwargs(batch: Batch) -> dict:
            shard = build_cp_shard(assignments[id(batch)], comm.cp_rank, comm.cp_group)
            return {"plait_mask": mask_of(batch), "plait_cp": shard}

        mine = batches[comm.dp_rank * m : (comm.dp_rank + 1) * m]
        targets = sum(b.target_tokens for b in batches)
        res = run_pipeline_step(stages, schedule, mine, targets, comm, llm_kwargs=[llm_kwargs(b) for b in mine],
                                loss_fn=token_loss_sum,
                                instrument=case.instrument)
        _close(res.loss, reference_cp_step(ref, batches), f"{where}: loss")
        covered.update(_check_grads(stages, ref, where))
        needed.update(n for n, p in ref.trainable_parameters() if p.grad is not None)
        timeline = gather_timeline(res.events, comm)  # one pipeline's events: CP rank 0 of DP replica 0
        assert len(timeline) == (sum(len(a) for a in schedule.actions) if dist.get_rank() == 0 else 0), where
        _check_clip_and_step(stages, ref, res, case, comm, (opt, ref_opt), where)
    _check_coverage(covered, needed, case.name)
    return uneven


def cp_worker(rank: int, world: int, port: int, cp: int) -> None:
    """Entry point of one spawned PP x CP process: run every case of :data:`CASES_PP_CP`."""
    with gloo_group(rank, world, port):
        uneven = [run_cp_case(case, cp) for case in CASES_PP_CP]
        assert all(uneven), f"every case must have a microbatch with uneven CP shards: {uneven}"
