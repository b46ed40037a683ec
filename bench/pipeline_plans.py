"""Pipeline layout plans for the nine MLLMs of the Cornstarch evaluation: Megatron-style even split vs the
best frozen-unaware plan vs plait's frozen-aware search, on simulated H100s.

Models (Jang et al., "Efficient Distributed MLLM Training with Cornstarch", arXiv 2503.11367; summary in
../shared/REFERENCES.md section 1): VLM/ALM/VALM in sizes S/M/L. Their costs come from the analytic,
frozen-aware cost model (``plait.planner.cost.analytic``) fed with the public configs written out below as
dicts (Hugging Face field names); families the cost model does not read (Pixtral, Qwen2-VL vision) are given
as ``EncoderArch`` directly. Uncertain figures are marked ``# uncertain``.

Workload per sample (one sample per microbatch, 24 microbatches per iteration): 1024 text tokens, one
1280x720 image and (audio models) one 30 s clip = 1500 Whisper frames. By default (``--image native``)
every vision encoder patches the whole 1280x720 image with its own patch size (patch 14: 91 x 51 = 4641
patches, plus CLS where the family has one; Pixtral 16: 80 x 45; Qwen2-VL: 92 x 52 after rounding to
multiples of 28), position embeddings interpolated. With ``--image resized`` fixed-resolution encoders see
the image resized to their configured size, as their Hugging Face processors do (SigLIP 384: 729 patches;
InternViT-6B 448: 1025 tokens; ViT-22B and EVA-CLIP-18B 224: 257 tokens). The LLM sequence is the text
plus every feature (InternVL pixel-shuffles 4 patches into one token, Qwen2-VL merges 2x2 patches,
Qwen2-Audio pools frames by 2; CLS tokens are not sent). Device: ``DeviceSpec.h100()`` (989 TFLOP/s
bf16 at 50% efficiency), memory cap 90% of 80 GiB (the rest for the CUDA context, workspaces,
fragmentation), stage-to-stage P2P at NVLink speed (450 GB/s, 10 us), DP gradient all-reduce over a
50 GB/s, 10 us link (one 400 Gb/s NIC per GPU), AdamW (16 bytes per trainable parameter with bf16 weights
and gradients).

Settings: ``frozen`` (frozen encoders, trainable projectors, frozen LLM) and ``trainable`` (everything
trains). For 8, 16 and 32 GPUs the tables give the simulated iteration time (true frozen-aware costs) of:

- A: Megatron-style even split by unit count, encoders first (stages crossing a module boundary share a
  rank), DP degree picked by the frozen-unaware model (``megatron_even_split``); A*: the same split with
  the DP degree that is best with the true costs (a more generous baseline);
- B: the best frozen-unaware plan (``plan_parallel`` with ``SearchSpace(frozen_aware=False)``: searched with f + dX + dW
  everywhere, evaluated with the true costs);
- C: plait's plan (``search_parallel.plan_parallel``: ``plan_layout``, and when no plan fits the memory cap, tensor
  parallelism (2/4/8, all-reduces on the NVLink link), FSDP2 sharding (shard degree dividing the DP degree,
  collectives on the DP link) and activation checkpointing (selective / full) searched too; column
  ``TP/FSDP/AC``: ``t<tp> s<dp_shard> sel|full``, ``-`` for none), and when nothing fits without it FSDP2 CPU
  offload (``parallel.offload = "cpu"``, ``planner.offload``: shards, gradients and AdamW on the host, 256 GiB of
  host memory per GPU, 25 GB/s host-device copies, the host's AdamW at 2.5e8 parameters/s per GPU:
  ``offload.HostSpec``'s documented defaults), shown as ``off`` at the end of the layout column.

- Z: C with the zero-bubble schedules weighed beside 1F1B for plans of one stage per rank (``ZB-H1``, ``ZB-H2``,
  Qi et al., ICLR 2024), and ``ZB-V`` on that plan's LLM cut into two stages per rank in a V (Qi et al., NeurIPS
  2024; ``SearchSpace.schedules``): the schedule it chose, Z/A and Z/C (the schedule alone: plait's search with and
  without them).

B and C search the same schedules: 1F1B, and interleaved 1F1B with ``v`` in ``--virtual-stages`` (default
1, 2, 4) LLM chunks per LLM rank (``schedules_interleaved.interleaved_1f1b``; Narayanan et al., SC'21,
section 2.2.2), with encoders on their own ranks, one stage each on the first LLM rank (``attach_encoders``) or one
stage on the last LLM rank, in its bubbles (``in_bubble``, with 1F1B or the zero-bubble H schedules). A stays
the Megatron-style even split under standard 1F1B.

Each with its ratio to the lower bound ``24 x (total true work per microbatch) / GPUs``, its layout
(``par``: encoder-parallel, ``col``: encoders colocated, ``att``: one stage per encoder on the first LLM
rank, ``mix``: other stages sharing ranks), DP degree, stages per module (``PxV``: ``P`` LLM ranks with
``V`` chunks each) and schedule (``1f1b``, or ``iV`` for interleaved 1F1B); then the speedups C/A, C/A*, C/B (time of the baseline / time of C). Table 1 searches
the DP degree (divisors of the GPU count up to the microbatch count) for every method; Table 2 fixes
DP = 1 (one pipeline over all GPUs, where only the partition and layout differ). A baseline marked ``!``
exceeds the memory cap at every DP degree (its best-predicted plan is shown) and is left out of the
means, as are rows where no plan of C fits; such a row says when no plan can fit without CPU offload (the model's
parameters, gradients and AdamW state exceed the memory of all the GPUs together; offload needs FSDP2 over DP
ranks, so Table 2's single pipeline cannot use it).
Table 3 runs Table 1's search on two models people fine-tune now, written out from their public configs:
Qwen3-VL-8B (Qwen3-8B text model; 27-layer vision tower, patch 16, 2x2 merger: 44 x 80 patches of the image; its
three DeepStack mergers, and their features carried to LLM layers 0-2, costed) and the Qwen2.5-Omni-7B thinker
(Qwen2.5-7B; the Qwen2.5-VL vision tower with window attention; a Whisper-large-v3-shaped audio tower, frames pooled
by 2). They are kept out of the nine-model means so those stay comparable with earlier runs.
The lower bound stays one with TP, sharding and recomputation (they only add device-seconds); every ratio is
checked to be at least 1. Each table ends with a check that B, C and Z are monotone in the GPU count (no row slower
than the same model's row with a GPU count dividing it; ``plan_parallel`` weighs every divisor's plan). Finally the
wall time of full layout searches for 1,024 GPUs (every layout and DP degree), and of plait's complete search
(``plan_parallel``: also TP, FSDP2, checkpointing and the divisors) once.

Rows whose C has at least 4 microbatches per pipeline rank and is above 1.15x its lower bound end with ``C: *`` and
the largest part of the gap (``gap_parts``: bubble, imbalance between ranks, communication after the flush, other
work).

Table 4 (``--samples``, default 4 samples per microbatch: 24 microbatches of 4 samples, each module's tokens four
times one sample's) sets C (one data-parallel degree for every module) beside E, the same search with per-encoder
data-parallel degrees (``SearchSpace.encoder_dp``: each encoder branch's stages on up to ``--samples`` replica ranks,
each running an equal share of every microbatch's samples; ``search.encoder_dp``): MegatronMIMO's comparison of the
encoder under its own parallelism against the homogeneous plan on the same GPUs. Per row: both plans, the encoder
degrees E chose, C/E, and E's bound note; then the mean gain over the nine models, frozen and trainable.

Run: ``.venv/bin/python bench/pipeline_plans.py`` (``--help``: GPU counts, microbatches, models, the tables,
the 1,024-GPU search size).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

from plait.models.plan_inputs import encoder_arch
from plait.planner.cost.arch import EncoderArch, arch_from_config, model_param_count, units_from_configs
from plait.planner.cost.analytic import unit_costs
from plait.planner.cost.types import DeviceSpec, MicrobatchShape
from plait.planner.pipeline.graph import consistent_units
from plait.planner.cost.analytic import unit_static_bytes
from plait.planner.search.types import LayoutChoice, Machine, SearchSpace
from plait.planner.search.layout import megatron_even_split, plan_layout
from plait.planner.search.parallel import plan_parallel
from plait.planner.pipeline.types import P2PModel

TEXT_TOKENS = 1024
AUDIO_FRAMES = 1500
MICROBATCHES = 24
VIRTUAL_STAGES = [1, 2, 4]  # LLM chunks per LLM rank B and C may choose (1: 1F1B; more: interleaved 1F1B)
DEVICE = DeviceSpec.h100()
MEMORY_CAP = 0.9 * DEVICE.memory_bytes
P2P = P2PModel(latency_s=DEVICE.link_latency, bandwidth_Bps=DEVICE.link_bandwidth)
DP_LINK = P2PModel(latency_s=1e-5, bandwidth_Bps=50e9)

# ----- LLMs (HF config fields) --------------------------------------------------------------------
LLAMA3_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
PHI3_SMALL = dict(  # Phi-3-small-8k: GEGLU (gated) MLP, biases; block-sparse attention every other layer ignored
    model_type="phi3small", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, vocab_size=100352, attention_bias=True, mlp_bias=True)
MISTRAL_7B = dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)
GEMMA2_27B = dict(model_type="gemma2", hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
                  num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=256000,
                  sliding_window=4096, tie_word_embeddings=True,
                  layer_types=["sliding_attention", "full_attention"] * 23)
INTERNLM2_20B = dict(model_type="internlm2", hidden_size=6144, intermediate_size=16384, num_hidden_layers=48,
                     num_attention_heads=48, num_key_value_heads=8, vocab_size=92544, bias=False)
QWEN2_14B = dict(  # no Qwen2-14B exists: Qwen1.5-14B dimensions (MHA, 40 kv heads)
    model_type="qwen2", hidden_size=5120, intermediate_size=13696, num_hidden_layers=40,
    num_attention_heads=40, num_key_value_heads=40, vocab_size=152064)
QWEN2_72B = dict(model_type="qwen2", hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, vocab_size=152064)
MIXTRAL_8X7B = dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                    num_experts_per_tok=2)
LLAMA3_70B = dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)

# ----- Vision encoders ----------------------------------------------------------------------------
PIXTRAL_400M = EncoderArch(  # Pixtral-12B vision tower: RMSNorm, gated (SwiGLU) MLP, no biases, 2D RoPE
    modality="vision", hidden=1024, layers=24, heads=16, head_dim=64, intermediate=4096, gated_mlp=True,
    qkv_bias=(False, False, False), o_bias=False, mlp_bias=False, norm_bias=False, patch=(16, 16),
    patch_bias=False, pre_norm=True, post_norm=False, item_len=(1280 // 16) * (720 // 16))
SIGLIP_SO400M = dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                     num_hidden_layers=27, num_attention_heads=16, image_size=384, patch_size=14)
# InternViT-6B has no plait family: its facts come from intern_vit_6b_arch
INTERNVIT_6B = dict(model_type="intern_vit_6b", hidden_size=3200, intermediate_size=12800, num_hidden_layers=45,
                    num_attention_heads=25, image_size=448, patch_size=14, qk_normalization=True,
                    norm_type="rms_norm", qkv_bias=False)


def intern_vit_6b_arch(config: dict[str, Any]) -> EncoderArch:
    """InternViT-6B from its config fields: a ViT with a CLS token, layer scale, optional q/k norms (``H`` each),
    RMS or LayerNorm, no post-norm."""
    bias = bool(config.get("qkv_bias", False))
    return dataclasses.replace(
        arch_from_config(dict(config, qkv_bias=bias)), layer_scale=True, post_norm=False,
        norm_bias=config.get("norm_type", "rms_norm") == "layer_norm",
        qk_norm_dim=config["hidden_size"] if config.get("qk_normalization", False) else 0)


QWEN2VL_GRID = (round(720 / 28) * 2, round(1280 / 28) * 2)  # 52 x 92 patches of 14 px after smart resize
QWEN2VL_VIT_675M = EncoderArch(  # Qwen2-VL vision: 3D patch conv (2 frames x 14 x 14, as 6 channels), RoPE,
    modality="vision", hidden=1280, layers=32, heads=16, head_dim=80, intermediate=5120,  # merger LN = post-norm
    num_channels=6, patch=(14, 14), patch_bias=False, output_pool=4, item_len=QWEN2VL_GRID[0] * QWEN2VL_GRID[1])
VIT_22B = dict(model_type="vit", hidden_size=6144, intermediate_size=24576, num_hidden_layers=48,
               num_attention_heads=48, image_size=224, patch_size=14, qkv_bias=False)
EVA_CLIP_18B = dict(  # uncertain: 5120 wide, 48 deep, MLP 20480 gives 15.1B vision parameters (published 17.5B)
    model_type="clip_vision_model", hidden_size=5120, intermediate_size=20480, num_hidden_layers=48,
    num_attention_heads=40, image_size=224, patch_size=14)

# ----- Audio encoders (Whisper encoder fields) ------------------------------------------------------
WHISPER_SMALL = dict(model_type="whisper", d_model=768, encoder_layers=12, encoder_attention_heads=12,
                     encoder_ffn_dim=3072, num_mel_bins=80, max_source_positions=1500)
WHISPER_MEDIUM = dict(model_type="whisper", d_model=1024, encoder_layers=24, encoder_attention_heads=16,
                      encoder_ffn_dim=4096, num_mel_bins=80, max_source_positions=1500)
WHISPER_LARGE_V3 = dict(model_type="whisper", d_model=1280, encoder_layers=32, encoder_attention_heads=20,
                        encoder_ffn_dim=5120, num_mel_bins=128, max_source_positions=1500)
QWEN2_AUDIO_ENC = dict(model_type="qwen2_audio_encoder", d_model=1280, encoder_layers=32,
                       encoder_attention_heads=20, encoder_ffn_dim=5120, num_mel_bins=128, max_source_positions=1500)

# ----- Models people fine-tune now (Table 3; not in the Cornstarch means) --------------------------------
QWEN3_8B = dict(  # Qwen/Qwen3-VL-8B-Instruct text_config: Qwen3-8B's dimensions (q/k norms), interleaved M-RoPE
    model_type="qwen3_vl_text", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936)
QWEN3VL_VISION = dict(  # its vision_config: DeepStack features of blocks 8, 16, 24 into LLM layers 0, 1, 2
    model_type="qwen3_vl_vision", depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3,
    patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=4096, num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24])
QWEN3VL_GRID = (round(720 / 32) * 2, round(1280 / 32) * 2)  # 44 x 80 patches of 16 px after smart resize
QWEN25_7B = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)
OMNI_VISION = dict(  # Qwen2.5-Omni-7B thinker's vision tower (the Qwen2.5-VL ViT: window attention, 2x2 merger)
    model_type="qwen2_5_vl_vision", depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
    in_channels=3, patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
    out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31])
OMNI_AUDIO = dict(  # Qwen2.5-Omni-7B thinker's audio tower: Whisper-large-v3 shape, frames pooled by 2
    model_type="qwen2_audio_encoder", d_model=1280, encoder_layers=32, encoder_attention_heads=20,
    encoder_ffn_dim=5120, num_mel_bins=128, max_source_positions=1500)
NEW_MODELS: dict[str, dict[str, Any]] = {
    "Qwen3-VL-8B": {"llm": QWEN3_8B, "vision": QWEN3VL_VISION},
    "Omni-7B": {"llm": QWEN25_7B, "vision": OMNI_VISION, "audio": OMNI_AUDIO},
}
NATIVE_GRIDS = {id(QWEN3VL_VISION): QWEN3VL_GRID, id(OMNI_VISION): QWEN2VL_GRID}  # patches of the 1280x720 image

MODELS: dict[str, dict[str, Any]] = {
    "VLM-S": {"llm": LLAMA3_8B, "vision": PIXTRAL_400M},
    "ALM-S": {"llm": PHI3_SMALL, "audio": WHISPER_SMALL},
    "VALM-S": {"llm": MISTRAL_7B, "vision": SIGLIP_SO400M, "audio": WHISPER_SMALL},
    "VLM-M": {"llm": GEMMA2_27B, "vision": INTERNVIT_6B},
    "ALM-M": {"llm": INTERNLM2_20B, "audio": WHISPER_MEDIUM},
    "VALM-M": {"llm": QWEN2_14B, "vision": QWEN2VL_VIT_675M, "audio": WHISPER_MEDIUM},
    "VLM-L": {"llm": QWEN2_72B, "vision": VIT_22B},
    "ALM-L": {"llm": MIXTRAL_8X7B, "audio": QWEN2_AUDIO_ENC},
    "VALM-L": {"llm": LLAMA3_70B, "vision": EVA_CLIP_18B, "audio": WHISPER_LARGE_V3},
}
ALL_MODELS = {**MODELS, **NEW_MODELS}


IMAGE_HW = (720, 1280)
IMAGE_MODE = {"mode": "native"}  # set from --image


def model_configs(name: str) -> tuple[dict[str, Any], dict[str, MicrobatchShape]]:
    """(model_configs for ``units_from_configs``, per-module microbatch shapes) of one benchmark model."""
    parts = ALL_MODELS[name]
    configs: dict[str, Any] = {}
    shapes: dict[str, MicrobatchShape] = {}
    llm_tokens = TEXT_TOKENS
    for module in ("vision", "audio"):
        if module not in parts:
            continue
        given = parts[module]
        if module == "vision" and isinstance(given, dict) and IMAGE_MODE["mode"] == "native":
            given = dict(given, image_size=list(IMAGE_HW))
        arch = intern_vit_6b_arch(given) if parts[module] is INTERNVIT_6B else encoder_arch(given)
        if id(parts[module]) in NATIVE_GRIDS:  # merger families: every patch of the image (no window sized item)
            rows, cols = NATIVE_GRIDS[id(parts[module])]
            arch = dataclasses.replace(arch, item_len=rows * cols)
        if parts[module] is INTERNVIT_6B:  # pixel shuffle 0.5: 4 patch features -> 1 token of 4 x 3200
            arch = dataclasses.replace(arch, output_pool=4)
            configs["vision.projector"] = {"kind": "mlp", "in_dim": 4 * arch.hidden}
        if arch is QWEN2VL_VIT_675M:  # 2 x 2 patch merger: 4 x 1280 -> MLP
            configs["vision.projector"] = {"kind": "mlp", "in_dim": 4 * arch.hidden}
        configs[module] = arch
        tokens = AUDIO_FRAMES if module == "audio" else arch.item_len
        shapes[module] = MicrobatchShape(tokens=tokens)
        features = tokens // arch.output_pool
        if module == "vision" and arch.prefix_tokens:
            features -= arch.prefix_tokens // arch.output_pool  # the CLS token is not sent to the LLM
        llm_tokens += features
    configs["llm"] = parts["llm"]
    shapes["llm"] = MicrobatchShape(tokens=llm_tokens, seq_len=llm_tokens)
    return configs, shapes


def build(name: str, setting: str, samples: int = 1):
    """(units, costs, LLM tokens) of a model in a setting (``"frozen"`` or ``"trainable"``), with ``samples`` samples
    per microbatch (each module's tokens times ``samples``, sequences and items of one sample's length)."""
    configs, shapes = model_configs(name)
    if samples > 1:
        shapes = {m: MicrobatchShape(tokens=samples * s.tokens, seq_len=(s.seq_len or s.tokens) if m == "llm"
                                     else s.seq_len) for m, s in shapes.items()}
    frozen: dict[str, bool] = {}
    if setting == "frozen":
        for module in configs:
            if module == "llm":
                frozen["llm"] = True
            elif not module.endswith(".projector"):
                frozen[module] = True
                frozen[f"{module}.projector"] = False
    units = units_from_configs(configs, frozen)
    costs = unit_costs(units, configs, shapes, DEVICE)
    return units, costs, shapes["llm"].tokens


def _encoder_share(name: str, setting: str) -> float:
    """Fraction of one microbatch's true work (forward + backward) spent in the encoders and projectors."""
    units, costs, _ = build(name, setting)
    work = [c.forward_s + c.backward_s(u) for u, c in zip(consistent_units(units), costs)]
    return sum(w for u, w in zip(units, work) if u.module != "llm") / sum(work)


def _layout_tag(choice: LayoutChoice) -> str:
    """Layout (``par``/``col``; ``att``: one stage per encoder on the first LLM rank; ``bub``: the encoders on the
    last LLM rank, in its bubbles; ``mix``: other shared ranks), DP degree, stages per module and schedule: ``1f1b``, or ``i<v>`` for interleaved 1F1B with ``v``
    LLM chunks per rank (the LLM count is then LLM ranks x v), ``zbv`` for ZB-V (LLM ranks x 2 in a V; the zero-bubble
    ``zb_h1``/``zb_h2`` of one stage per rank are named in column Z's schedule); `` off`` with FSDP2 CPU offload."""
    plan = choice.plan
    v = plan.virtual_stages if choice.schedule in ("interleaved_1f1b", "zb_v") else 1
    llm_ranks = {plan.stages[s].rank for s in plan.llm_stages}
    attached = plan.llm_stages[0] > 0 and all(s.rank == plan.stages[plan.llm_stages[0]].rank
                                               for s in plan.stages[: plan.llm_stages[0]])
    last_llm = plan.stages[plan.llm_stages[-1]].rank
    encoder_ranks = {s.rank for s in plan.stages[: plan.llm_stages[0]]}
    if attached and len(llm_ranks) > 1:
        tag = "att"
    elif all(s.rank == last_llm for s in plan.stages[: plan.llm_stages[0]]) and len(llm_ranks) > 1 and v == 1:
        tag = "bub"
    elif choice.encoder_dp and encoder_ranks <= llm_ranks:  # encoder replicas spread over the LLM ranks' bubbles
        tag = "bub"
    elif plan.num_ranks < plan.num_stages and v == 1:
        tag = "mix"
    else:
        tag = "par" if choice.layout == "encoder_parallel" else "col"
    counts = [str(s) for _, s in choice.stages_per_module]
    if v > 1:
        counts[-1] = f"{s // v}x{v}" if (s := choice.stages_per_module[-1][1]) else counts[-1]
    sched = "zbv" if choice.schedule == "zb_v" else f"i{v}" if v > 1 else "1f1b"
    return f"{tag} dp{choice.dp} {'+'.join(counts)} {sched}" + (" off" if choice.offload == "cpu" else "")


def _generous_megatron(units, costs, gpus: int, microbatches: int, dps: list[int]) -> LayoutChoice | None:
    """A*: the even split with the DP degree that is best with the true costs (among those that fit memory,
    if any does)."""
    best = None
    for dp in dps:
        if gpus // dp > len(units):
            continue
        choice = megatron_even_split(units, costs, gpus, microbatches=microbatches, dp=dp,
                                     machine=Machine(memory_cap=MEMORY_CAP, p2p=P2P, dp_link=DP_LINK))
        if best is None or (choice.fits_memory, -choice.iteration_s) > (best.fits_memory, -best.iteration_s):
            best = choice
    return best


ZERO_BUBBLE = ("1f1b", "zb_h1", "zb_h2", "zb_v")
"""The schedules column Z weighs (``SearchSpace.schedules``)."""


def _run_one(units, costs, gpus: int, microbatches: int, dp_fixed: int | None) -> dict[str, LayoutChoice | None]:
    """A, A*, B, C and Z (C with the zero-bubble schedules weighed) for one model, setting and GPU count
    (``dp_fixed``: one DP degree for all)."""
    machine = Machine(memory_cap=MEMORY_CAP, p2p=P2P, dp_link=DP_LINK)
    dps = [dp_fixed] if dp_fixed else [d for d in range(1, min(gpus, microbatches) + 1) if gpus % d == 0]
    space = SearchSpace(dp_degrees=dps, virtual_stages=VIRTUAL_STAGES, attach_encoders=True, in_bubble=True)
    unaware = dataclasses.replace(space, frozen_aware=False)
    out: dict[str, LayoutChoice | None] = {}
    for key, call in (("A", lambda: megatron_even_split(units, costs, gpus, microbatches=microbatches, dp=dp_fixed,
                                                        machine=machine)),
                      ("B", lambda: plan_parallel(units, costs, gpus, microbatches=microbatches, machine=machine,
                                                  space=unaware)),
                      ("C", lambda: plan_parallel(units, costs, gpus, microbatches=microbatches, machine=machine,
                                                  space=space)),
                      ("Z", lambda: plan_parallel(units, costs, gpus, microbatches=microbatches, machine=machine,
                                                  space=dataclasses.replace(space, schedules=ZERO_BUBBLE)))):
        try:
            out[key] = call()
        except ValueError:
            out[key] = None
    out["A*"] = _generous_megatron(units, costs, gpus, microbatches, dps)
    return out


def _cell(choice: LayoutChoice | None, degrees: bool = False) -> str:
    """Time, ratio to the lower bound and layout tag (34 characters); with ``degrees`` also the TP / FSDP2 /
    checkpointing tag (``_degrees_tag``, 10 more)."""
    if choice is None:
        return f"{'(no fit)':>34}" + (" " * 10 if degrees else "")
    mark = " " if choice.fits_memory else "!"
    if choice.ratio_to_lower_bound < 1:
        raise AssertionError(f"lower bound {choice.lower_bound_s} above the time {choice.iteration_s}: not a bound")
    cell = f"{choice.iteration_s:7.3f}s{mark}{choice.ratio_to_lower_bound:4.2f}x {_layout_tag(choice):<20}"
    return cell + (f" {_degrees_tag(choice):<9}" if degrees else "")


def _degrees_tag(choice: LayoutChoice) -> str:
    """``t<tp> s<dp_shard> <ac>`` (``ac``: ``sel``/``full``) of a plan with TP, FSDP2 or checkpointing; ``-``
    without."""
    parts = [f"t{choice.tp}"] if choice.tp > 1 else []
    parts += [f"s{choice.dp_shard}"] if choice.dp_shard > 1 else []
    parts += [{"selective": "sel", "full": "full"}[choice.checkpointing]] if choice.checkpointing != "none" else []
    return " ".join(parts) or "-"


def _state_floor(units, costs, gpus: int) -> str:
    """Why no plan can fit without CPU offload: the model's parameters, gradients and AdamW state over all GPUs
    exceed the cap ('' when they do not: the state alone could fit when fully sharded)."""
    state = sum(unit_static_bytes(u, c) for u, c in zip(consistent_units(units), costs))
    if state <= gpus * MEMORY_CAP:
        return ""
    return (f"  (state {state / 2**30:.0f} GiB > {gpus} x cap {MEMORY_CAP / 2**30:.0f} GiB: no plan fits without "
            "CPU offload)")


def _speedup(base: LayoutChoice | None, ours: LayoutChoice | None) -> float:
    """time(base) / time(ours); nan when either is missing or the baseline exceeds the memory cap."""
    if base is None or ours is None or not base.fits_memory:
        return float("nan")
    return base.iteration_s / ours.iteration_s


def run_table(names: list[str], gpu_counts: list[int], microbatches: int, dp_fixed: int | None) -> dict:
    """Print one side-by-side table; returns the speedups C/A, C/A*, C/B per setting."""
    speedups: dict[str, list[float]] = {}
    times: dict[tuple[str, str, str], list[tuple[int, float]]] = {}  # (model, setting, column) -> (GPUs, time)
    fits: dict[str, list[bool]] = {"C": [], "impossible": [], "offload": []}
    schedules: dict[str, int] = {}  # rows per schedule Z chose
    header = (f"{'model':<7} {'setting':<9} {'GPUs':>4} | {'A megatron even':<34} | {'A* (dp by true)':<34} | "
              f"{'B frozen-unaware':<34} {'TP/FSDP/AC':<9} | {'C plait':<34} {'TP/FSDP/AC':<9} |  C/A  C/A*  C/B | "
              f"{'Z: C + zero-bubble schedules':<34} {'schedule':<16}  Z/A  Z/C")
    print(header)
    print("-" * len(header))
    for name in names:
        for setting in ("frozen", "trainable"):
            units, costs, _ = build(name, setting)
            for gpus in gpu_counts:
                res = _run_one(units, costs, gpus, microbatches, dp_fixed)
                ratios = [_speedup(res[k], res["C"]) for k in ("A", "A*", "B")]
                for key, value in zip(("A", "A*", "B"), ratios):
                    speedups.setdefault((setting, key), []).append(value)
                zb = [_speedup(res["A"], res["Z"]), _speedup(res["C"], res["Z"])]
                speedups.setdefault((setting, "Z/A"), []).append(zb[0])
                speedups.setdefault((setting, "Z/C"), []).append(zb[1])
                chosen = res["Z"].schedule if res["Z"] is not None else "-"
                schedules[chosen] = schedules.get(chosen, 0) + 1
                for key in ("B", "C", "Z"):
                    if res[key] is not None and res[key].fits_memory:
                        times.setdefault((name, setting, key), []).append((gpus, res[key].iteration_s))
                fits["C"].append(res["C"] is not None and res["C"].fits_memory)
                fits["impossible"].append(bool(_state_floor(units, costs, gpus)))
                fits["offload"].append(fits["C"][-1] and res["C"].offload == "cpu")
                print(f"{name:<7} {setting:<9} {gpus:>4} | {_cell(res['A'])} | {_cell(res['A*'])} | "
                      f"{_cell(res['B'], True)} | {_cell(res['C'], True)} | " + " ".join(f"{r:4.2f}" for r in ratios)
                      + f" | {_cell(res['Z'])} {chosen:<16} " + " ".join(f"{r:4.2f}" for r in zb)
                      + ("" if fits["C"][-1] else _state_floor(units, costs, gpus)) + _spaced(_bound_note(res["C"])))
        print()
    for setting in ("frozen", "trainable"):
        parts = []
        for key in ("A", "A*", "B"):
            values = speedups[(setting, key)]
            finite = [v for v in values if v == v]
            parts.append(f"C/{key} {_mean(finite):.2f}x ({len(finite)} of {len(values)} rows)")
        zb = [f"{key} {_mean(speedups[(setting, key)]):.2f}x" for key in ("Z/A", "Z/C")]
        print(f"mean speedup, {setting}: " + "; ".join(parts) + "; zero-bubble schedules weighed: " + ", ".join(zb))
    slower = [f"{name} {setting} {key} {gpus} GPUs ({t:.3f} s > {fewer} GPUs' {tf:.3f} s)"
              for (name, setting, key), rows in times.items() for gpus, t in rows for fewer, tf in rows
              if fewer < gpus and gpus % fewer == 0 and t > tf * (1 + 1e-9)]
    print("monotone in the GPU count (B, C, Z: no row slower than the same model's row with fewer GPUs): "
          + ("yes" if not slower else f"no, {len(slower)} rows: " + "; ".join(slower)))
    print("schedules Z chose: " + ", ".join(f"{name} in {n} rows" for name, n in sorted(schedules.items())))
    possible = [f for f, imp in zip(fits["C"], fits["impossible"]) if not imp]
    print(f"C fits the memory cap in {sum(fits['C'])} of {len(fits['C'])} rows ({sum(fits['offload'])} with CPU "
          f"offload); {len(fits['C']) - len(possible)} rows hold more state than all their GPUs (they fit only with "
          f"offload); C fits {sum(possible)} of the other {len(possible)}")
    return speedups


def _rank_busy(choice: LayoutChoice) -> list[float]:
    """Per pipeline rank, its stages' work per microbatch (s; a replica's share for a replicated encoder stage)."""
    busy = [0.0] * choice.plan.num_ranks
    for stage, work in zip(choice.plan.stages, choice.stage_work_s):
        busy[stage.rank] += work
    return busy


def gap_parts(choice: LayoutChoice) -> dict[str, float]:
    """Where a plan's time above its lower bound goes (seconds of the iteration), from the simulator's figures:
    ``bubble`` (the makespan beyond the busiest rank's work: warm-up, drain, waiting on transfers), ``imbalance``
    (the busiest rank's work beyond the mean rank's), ``communication`` (gradient synchronisation, the optimizer step
    and offload after the flush) and ``work`` (the rest: GPUs left idle, TP collectives, recomputation, runtime
    overheads and microbatches rounded up per replica)."""
    busy = _rank_busy(choice)
    nb = choice.microbatches_per_replica
    bubble = choice.makespan_s - nb * max(busy)
    imbalance = nb * (max(busy) - statistics.fmean(busy))
    communication = choice.grad_sync_s + choice.update_s + choice.offload_s
    rest = choice.iteration_s - choice.lower_bound_s - bubble - imbalance - communication
    return {"bubble": bubble, "imbalance": imbalance, "communication": communication, "work": rest}


BOUND_MARK = 1.15
"""Rows with at least 4 microbatches per pipeline rank whose plan is above this ratio to the lower bound are marked."""


def _bound_note(choice: LayoutChoice | None) -> str:
    """``*`` and the largest part of the gap (``gap_parts``) for a plan with at least 4 microbatches per pipeline rank
    above ``BOUND_MARK`` x its lower bound; '' otherwise."""
    if choice is None or choice.microbatches_per_replica < 4 * choice.plan.num_ranks:
        return ""
    if choice.ratio_to_lower_bound <= BOUND_MARK:
        return ""
    parts = gap_parts(choice)
    gap = choice.iteration_s - choice.lower_bound_s
    main = max(parts, key=parts.get)
    return f"* {main} {100 * parts[main] / gap:.0f}% of the gap"


def _degrees_of(choice: LayoutChoice | None) -> str:
    """``vision 2, audio 1``: the data-parallel degree of each encoder branch's stages (``-`` without encoders)."""
    if choice is None:
        return "-"
    replicated = dict(choice.encoder_dp)
    encoders = [m for m, _ in choice.stages_per_module if m != "llm"]
    return ", ".join(f"{m} {replicated.get(m, 1)}" for m in encoders) or "-"


def run_encoder_dp_table(names: list[str], gpu_counts: list[int], microbatches: int, samples: int) -> None:
    """Table 4: plait's plan with one set of degrees for every module (C, every encoder's ``encoder_dp`` 1) against
    the same search with per-encoder data-parallel degrees (E: powers of two up to ``samples``, the rows each
    microbatch holds per branch), on the same GPUs and workload (``microbatches`` of ``samples`` samples)."""
    machine = Machine(memory_cap=MEMORY_CAP, p2p=P2P, dp_link=DP_LINK)
    gains: dict[str, list[float]] = {"frozen": [], "trainable": []}
    ratios: list[tuple[str, float, str]] = []
    header = (f"{'model':<7} {'setting':<9} {'GPUs':>4} | {'C: one degree for every module':<34} "
              f"{'TP/FSDP/AC':<9} | {'E: per-encoder degrees':<34} {'TP/FSDP/AC':<9} {'encoder degrees':<20} | "
              f" C/E | bound note (E)")
    print(header)
    print("-" * len(header))
    for name in names:
        for setting in ("frozen", "trainable"):
            units, costs, _ = build(name, setting, samples)
            encoders = [m for m in dict.fromkeys(u.module for u in units) if m != "llm"]
            for gpus in gpu_counts:
                dps = [d for d in range(1, min(gpus, microbatches) + 1) if gpus % d == 0]
                space = SearchSpace(dp_degrees=dps, virtual_stages=VIRTUAL_STAGES, attach_encoders=True,
                                    in_bubble=True)
                found = {}
                for key, searched in (("C", space), ("E", dataclasses.replace(
                        space, encoder_dp=tuple((m, samples) for m in encoders)))):
                    try:
                        found[key] = plan_parallel(units, costs, gpus, microbatches=microbatches, machine=machine,
                                                   space=searched)
                    except ValueError:
                        found[key] = None
                gain = _speedup(found["C"], found["E"])
                gains[setting].append(gain)
                for key in ("C", "E"):
                    if found[key] is not None:
                        ratios.append((key, found[key].ratio_to_lower_bound, _bound_note(found[key])))
                print(f"{name:<7} {setting:<9} {gpus:>4} | {_cell(found['C'], True)} | {_cell(found['E'], True)} "
                      f"{_degrees_of(found['E']):<20} | {gain:4.2f} | {_bound_note(found['E'])}")
        print()
    for setting, values in gains.items():
        finite = [v for v in values if v == v]
        print(f"mean gain of per-encoder degrees (C/E), {setting}: {_mean(finite):.3f}x over {len(finite)} rows "
              f"(best {max(finite, default=float('nan')):.2f}x)")
    marked = [r for r in ratios if r[0] == "E" and r[2]]
    print(f"E: {len(marked)} rows with >= 4 microbatches per pipeline rank above {BOUND_MARK}x the lower bound "
          "(marked '*', with the largest part of the gap)")


def _spaced(note: str) -> str:
    return f"  C: {note}" if note else ""


def _mean(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return statistics.fmean(finite) if finite else float("nan")


def time_search(name: str, setting: str, gpus: int, microbatches: int, repeats: int) -> None:
    """Print the wall time of full layout searches (both layouts, all DP degrees) on ``gpus`` GPUs."""
    units, costs, _ = build(name, setting)
    for aware in (True, False):
        times, choice = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            try:
                choice = plan_layout(units, costs, gpus, microbatches=microbatches,
                                     machine=Machine(memory_cap=MEMORY_CAP, p2p=P2P, dp_link=DP_LINK),
                                     space=SearchSpace(frozen_aware=aware, virtual_stages=VIRTUAL_STAGES,
                                                       attach_encoders=True))
            except ValueError:
                choice = None
            times.append(time.perf_counter() - start)
        label = "frozen-aware" if aware else "frozen-unaware"
        if aware:  # plait's complete search (C): TP, FSDP2, checkpointing and every divisor of the GPUs
            start = time.perf_counter()
            try:
                full = plan_parallel(units, costs, gpus, microbatches=microbatches,
                                     machine=Machine(memory_cap=MEMORY_CAP, p2p=P2P, dp_link=DP_LINK),
                                     space=SearchSpace(virtual_stages=VIRTUAL_STAGES, attach_encoders=True))
                chosen = f"{_layout_tag(full)} {_degrees_tag(full)}, {full.ratio_to_lower_bound:.2f}x lower bound"
            except ValueError:
                chosen = "no plan fits memory"
            print(f"  {name} {setting:<9} plan_parallel  {gpus} GPUs, {microbatches:>4} microbatches: "
                  f"{time.perf_counter() - start:.2f} s (complete search, once); chosen {chosen}")
        found = (f"{choice.candidates} candidates bounded, {choice.simulated} timed; chosen {_layout_tag(choice)}, "
                 f"{choice.ratio_to_lower_bound:.2f}x lower bound" if choice else "no plan fits memory")
        print(f"  {name} {setting:<9} {label:<14} {gpus} GPUs, {microbatches:>4} microbatches: "
              f"min {min(times):.2f} s / max {max(times):.2f} s over {repeats}; {found}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--microbatches", type=int, default=MICROBATCHES)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--new-models", nargs="*", default=list(NEW_MODELS), choices=list(NEW_MODELS),
                        help="models people fine-tune now, in Table 3 (not in the Cornstarch means); none: skip it")
    parser.add_argument("--search-gpus", type=int, default=1024)
    parser.add_argument("--search-microbatches", type=int, nargs="+", default=[24, 1024],
                        help="global microbatches of the timed large searches")
    parser.add_argument("--search-models", nargs="+", default=["VALM-L", "VLM-S"], choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--virtual-stages", type=int, nargs="+", default=VIRTUAL_STAGES,
                        help="LLM chunks per LLM rank that B and C may choose (1 = 1F1B only)")
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 2, 3, 4], choices=[1, 2, 3, 4],
                        help="which tables to print (4: per-encoder data-parallel degrees)")
    parser.add_argument("--samples", type=int, default=4,
                        help="Table 4: samples per microbatch (each branch's rows, the most replicas an encoder gets)")
    parser.add_argument("--no-search-timing", action="store_true", help="skip the 1,024-GPU search timing")
    parser.add_argument("--image", choices=("native", "resized"), default="native",
                        help="vision encoders patch the 1280x720 image (native) or see it resized to their "
                             "configured size (resized); see the module docstring")
    args = parser.parse_args()
    IMAGE_MODE["mode"] = args.image
    VIRTUAL_STAGES[:] = args.virtual_stages
    print(f"{DEVICE.name}, cap {MEMORY_CAP / 2**30:.0f} GiB, {args.microbatches} microbatches of 1 sample "
          f"({TEXT_TOKENS} text tokens + one 1280x720 image, {args.image} (+ 30 s audio))")
    for name in [*args.models, *args.new_models]:
        units, _, tokens = build(name, "frozen")
        configs, _ = model_configs(name)
        sizes = ", ".join(f"{m} {model_param_count(c) / 1e9:.2f}B" for m, c in configs.items()
                          if not m.endswith(".projector"))
        shares = "/".join(f"{100 * _encoder_share(name, setting):.0f}%" for setting in ("frozen", "trainable"))
        print(f"  {name:<7} {len(units):>3} units, {tokens} LLM tokens; {sizes}; encoders {shares} of the work "
              "(frozen/trainable)")
    if 1 in args.tables:
        print("\nTable 1: DP degree searched (divisors of the GPU count up to the microbatches); '!' = over the "
              "memory cap (excluded from the means); rows without C: no plan fits\n")
        run_table(args.models, args.gpus, args.microbatches, None)
    if 2 in args.tables:
        print("\nTable 2: one pipeline over all GPUs (DP = 1)\n")
        run_table(args.models, args.gpus, args.microbatches, 1)
    if args.new_models and 3 in args.tables:
        print("\nTable 3: models people fine-tune now (DP degree searched as in Table 1; not in the Cornstarch "
              "means above)\n")
        run_table(args.new_models, args.gpus, args.microbatches, None)
    if 4 in args.tables:
        print(f"\nTable 4: per-encoder data-parallel degrees (encoder_dp) against one set of degrees for every module, "
              f"{args.microbatches} microbatches of {args.samples} samples\n")
        run_encoder_dp_table(args.models, args.gpus, args.microbatches, args.samples)
    if args.no_search_timing:
        return
    print(f"\nfull layout search, {args.search_gpus} GPUs (both layouts, every DP degree dividing the GPUs):")
    for name in args.search_models:
        for setting in ("frozen", "trainable"):
            for microbatches in args.search_microbatches:
                time_search(name, setting, args.search_gpus, microbatches, args.repeats)


if __name__ == "__main__":
    main()
