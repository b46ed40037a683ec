"""Expert parallelism (EP) in the planner: its choice for two mixture-of-experts MLLMs on 8-64 simulated H100s,
against the best plan without EP (``ep = 1``: FSDP2 / DP / pipelines only).

Models (public Hugging Face configs, written out below as dicts with their field names):

- **Qwen3-VL-30B-A3B** (``Qwen/Qwen3-VL-30B-A3B-Instruct``, ``config.json``): text ``qwen3_moe``-shaped: hidden
  2048, 48 layers (all sparse), 32 query / 4 key-value heads of 128, 128 routed experts, top-8, expert MLP 768,
  vocabulary 151936, no shared expert, untied head; vision tower (``qwen3_vl_vision``, plait's ``qwen3_vl``
  family): 27 layers, hidden 1152, MLP 4304, 16 heads, patch 16 (temporal 2), spatial merge 2, output 2048. The
  DeepStack mergers are not costed (the family's ``arch_fields``).
- **Qwen3-Omni-30B-A3B thinker** (``Qwen/Qwen3-Omni-30B-A3B-Instruct``, ``thinker_config``): the same MoE text
  shape (vocabulary taken as 151936, as the brief gives it; the thinker's published vocabulary may differ by a
  few hundred rows, under 0.1% of its parameters), the same vision tower, and the audio encoder (AuT): 32 layers,
  d_model 1280, 20 heads, MLP 5120, 128 mel bins. Assumption: it is costed as a Whisper-style encoder (plait's
  generic audio reader: two 1-D convolutions, 1500 frames per 30 s clip) whose 12.5 Hz output sends 375 tokens
  per 30 s clip to the LLM (``output_pool = 4``); the real AuT front end (2-D convolutions, 8x downsampling,
  chunked attention) differs in its first layer and attention pattern, not in its 32 transformer layers' weights.

Workload: one sample per microbatch, ``--microbatches`` (default 64) per step; a sample is 1024 text tokens and one
1280x720 image (smart-resized to 1280x736: 80 x 46 = 3680 patches of 16 px, 920 LLM tokens after the 2x2 merge),
plus for the thinker one 30 s clip (375 LLM tokens). Settings: ``frozen`` (vision/audio towers frozen, projectors
and the LLM train) and ``trainable`` (everything trains). Device: ``DeviceSpec.h100()`` (989 TFLOP/s bf16 at 50%),
memory cap 90% of 80 GiB, nodes of 8 GPUs on NVLink 4 (450 GB/s) with one 400 Gb/s InfiniBand port per GPU
between nodes (``node_presets.nvlink_infiniband``: every collective charged on the link its group uses), AdamW
(12 bytes of state per trained parameter, bf16 parameters and gradients). Routing: uniform (load imbalance factor
1.0; a measured router distribution enters through ``Profile.router_load``); ``--skew`` instead gives every layer
the load of a Zipf-like router (expert ``i``'s share proportional to ``1 / (i + 1)^skew``, experts shuffled the
same way in every layer) to show what imbalance costs.

Searched: ``plan_parallel`` over pipeline layouts and DP degrees, FSDP2 shard degrees, activation checkpointing
(none / full) and EP degrees (powers of two dividing 128 experts and the DP degree), TP 1 (a 2048-wide model gains
nothing from TP on H100s), 1F1B. Columns per GPU count: the EP plan (``EP``: degrees ``dp``/``dp_shard``/``ep``,
pipeline ranks, checkpointing (``full`` or ``-``); ``ep<E>*`` when its EP groups span nodes; predicted step
time; predicted per-rank memory: the fullest rank's parameters,
gradients, optimizer state, activations in flight and FSDP2's buffer), then the best plan with ``ep = 1``
(``FSDP2-only``: same search, no EP) and the ratio of its step time to the EP plan's (``gain``; above 1: EP faster).

Then the measured EP runs (a tiny MoE MLLM on gloo: per-rank memory and step time of EP vs FSDP2-only), from
``bench/moe_measured.py``'s ``measured_rows()`` when present.

Run: ``.venv/bin/python bench/moe.py`` (about a minute; ``--help`` for GPU counts, microbatches, models, settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from plait.models.plan_inputs import encoder_arch  # noqa: E402
from plait.planner.cost.analytic import unit_costs  # noqa: E402
from plait.planner.cost.arch import units_from_configs  # noqa: E402
from plait.planner.cost.experts import ExpertLayer, expert_layers  # noqa: E402
from plait.planner.cost.node_presets import nvlink_infiniband  # noqa: E402
from plait.planner.cost.topology import RANK_ORDERS, ep_crosses  # noqa: E402
from plait.planner.cost.types import DeviceSpec, MicrobatchShape  # noqa: E402
from plait.planner.report import format_bytes  # noqa: E402
from plait.planner.search.parallel import plan_parallel  # noqa: E402
from plait.planner.search.placement import rank_sizes  # noqa: E402
from plait.planner.search.types import LayoutChoice, Machine, NoPlanFits, SearchSpace  # noqa: E402

DEVICE = DeviceSpec.h100()
TOPOLOGY = nvlink_infiniband(8)
MEMORY_CAP = 0.9 * DEVICE.memory_bytes
TEXT_TOKENS = 1024
IMAGE_PATCHES = (1280 // 16) * (736 // 16)  # 1280x720 smart-resized to multiples of 32 px: 80 x 46 patches
AUDIO_FRAMES = 1500  # 30 s clip
AUDIO_POOL = 4  # 12.5 Hz tokens to the LLM: 375 per 30 s clip (assumption, module docstring)

QWEN3_MOE_TEXT = dict(  # Qwen3-VL-30B-A3B text_config (and the Omni thinker's text shape)
    model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    vocab_size=151936, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
QWEN3_VL_VISION = dict(  # Qwen3-VL-30B-A3B vision_config (Qwen3-Omni's vision tower has the same shape)
    model_type="qwen3_vl_vision", depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
    temporal_patch_size=2, spatial_merge_size=2, in_channels=3, out_hidden_size=2048)
QWEN3_OMNI_AUDIO = dict(  # Qwen3-Omni-30B-A3B thinker audio_config, costed Whisper-style (module docstring)
    model_type="whisper", d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
    num_mel_bins=128, max_source_positions=AUDIO_FRAMES)

MODELS: dict[str, dict[str, Any]] = {
    "Qwen3-VL-30B-A3B": {"vision": QWEN3_VL_VISION, "llm": QWEN3_MOE_TEXT},
    "Qwen3-Omni-30B-A3B thinker": {"vision": QWEN3_VL_VISION, "audio": QWEN3_OMNI_AUDIO, "llm": QWEN3_MOE_TEXT},
}
SETTINGS = ("frozen", "trainable")


def model_inputs(name: str, setting: str) -> tuple[list, list, dict[str, Any], dict[str, MicrobatchShape]]:
    """(units, costs, model_configs, shapes) of a model in a setting (module docstring)."""
    parts = MODELS[name]
    configs: dict[str, Any] = {}
    shapes: dict[str, MicrobatchShape] = {}
    llm_tokens = TEXT_TOKENS
    if "vision" in parts:
        vision = dataclasses.replace(encoder_arch(parts["vision"]), item_len=IMAGE_PATCHES)
        configs["vision"] = vision
        shapes["vision"] = MicrobatchShape(IMAGE_PATCHES, seq_len=IMAGE_PATCHES)
        llm_tokens += IMAGE_PATCHES // vision.output_pool
    if "audio" in parts:
        audio = dataclasses.replace(encoder_arch(parts["audio"]), output_pool=AUDIO_POOL)
        configs["audio"] = audio
        configs["audio.projector"] = {"kind": "mlp"}
        shapes["audio"] = MicrobatchShape(AUDIO_FRAMES)
        llm_tokens += AUDIO_FRAMES // AUDIO_POOL
    configs["llm"] = parts["llm"]
    shapes["llm"] = MicrobatchShape(llm_tokens, seq_len=llm_tokens)
    frozen = {m: True for m in configs if m not in ("llm",) and not m.endswith(".projector")}
    units = units_from_configs(configs, frozen if setting == "frozen" else {})
    return list(units), unit_costs(units, configs, shapes, DEVICE), configs, shapes


def zipf_load(experts: int, skew: float, seed: int = 0) -> tuple[float, ...]:
    """Per-expert token shares proportional to ``1 / (rank + 1)^skew``, the ranks shuffled by a fixed LCG (no
    randomness between runs)."""
    order = list(range(experts))
    state = seed + 12345
    for i in range(experts - 1, 0, -1):  # Fisher-Yates with a 31-bit LCG
        state = (1103515245 * state + 12345) % 2**31
        j = state % (i + 1)
        order[i], order[j] = order[j], order[i]
    shares = [0.0] * experts
    for rank, expert in enumerate(order):
        shares[expert] = 1.0 / (rank + 1) ** skew
    return tuple(shares)


def search(name: str, setting: str, gpus: int, microbatches: int, ep_degrees: tuple[int, ...] | None,
           skew: float) -> LayoutChoice | None:
    """The plan ``plan_parallel`` chooses (None when nothing fits)."""
    units, costs, configs, shapes = model_inputs(name, setting)
    layers: tuple[ExpertLayer, ...] = expert_layers(units, configs, shapes["llm"], DEVICE)
    if skew > 0:
        layers = tuple(dataclasses.replace(layer, load=zipf_load(layer.experts, skew)) for layer in layers)
    machine = Machine(memory_cap=MEMORY_CAP, topology=TOPOLOGY, host=None)
    space = SearchSpace(tp_degrees=(1,), checkpointing=("none", "full"), fsdp_reshard=("after_forward",),
                        ep_degrees=ep_degrees, rel_tol=0.01)
    try:
        return plan_parallel(units, costs, gpus, microbatches=microbatches, machine=machine, space=space,
                             experts=layers)
    except NoPlanFits:
        return None


def rank_bytes(choice: LayoutChoice) -> float:
    """The fullest rank's predicted bytes: its stage's peak plus FSDP2's buffer."""
    return max(choice.stage_memory_bytes) + choice.shard_buffer_bytes


def ep_across_nodes(choice: LayoutChoice) -> bool:
    """Whether the plan's EP groups span nodes under its own rank order (``topology.ep_crosses``)."""
    sizes = rank_sizes(tp=choice.tp, dp=choice.dp, dp_shard=choice.dp_shard, pp=choice.plan.num_ranks)
    return ep_crosses(RANK_ORDERS[choice.rank_order], sizes, choice.ep, TOPOLOGY.gpus_per_node)


def describe(choice: LayoutChoice | None) -> str:
    """``dp<D>/s<dp_shard>/ep<E> pp<P> ac|-  <step> s  <memory>`` (``ep<E>*``: EP groups across nodes); ``no plan
    fits`` for None."""
    if choice is None:
        return f"{'no plan fits':<44}"
    ac = "full" if choice.checkpointing == "full" else "-"
    across = "*" if choice.ep > 1 and ep_across_nodes(choice) else ""
    degrees = f"dp{choice.dp}/s{choice.dp_shard}/ep{choice.ep}{across} pp{choice.plan.num_ranks} {ac}"
    return f"{degrees:<24} {choice.iteration_s:7.3f} s {format_bytes(rank_bytes(choice)):>10}"


def print_table(models: list[str], settings: list[str], gpu_counts: list[int], microbatches: int,
                skew: float) -> None:
    """The simulated table (module docstring)."""
    head = (f"{'model':<27} {'setting':<9} {'GPUs':>4}  {'EP plan: degrees, step, memory/rank':<44}  "
            f"{'best ep=1 (FSDP2-only)':<44}  gain")
    print(head)
    print("-" * len(head))
    for name in models:
        for setting in settings:
            for gpus in gpu_counts:
                ep = search(name, setting, gpus, microbatches, None, skew)
                base = search(name, setting, gpus, microbatches, (1,), skew)
                gain = (f"{base.iteration_s / ep.iteration_s:5.2f}x" if ep is not None and base is not None
                        else "  -")
                print(f"{name:<27} {setting:<9} {gpus:>4}  {describe(ep)}  {describe(base)}  {gain}")


def print_measured() -> None:
    """The measured EP runs of ``bench/moe_measured.py`` (``measured_rows()``: printable lines), when present."""
    try:
        from moe_measured import measured_rows  # type: ignore[import-not-found]  # bench/moe_measured.py
    except ImportError:
        print("measured EP runs: not available")
        return
    print("measured EP runs (tiny MoE MLLM on gloo):")
    for row in measured_rows():
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64], help="GPU counts (default 8 16 32 64)")
    parser.add_argument("--microbatches", type=int, default=64, help="microbatches (samples) per step (default 64)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), metavar="MODEL",
                        help=f"models (default all: {', '.join(MODELS)})")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS,
                        help="frozen (encoders frozen) and/or trainable (default both)")
    parser.add_argument("--skew", type=float, default=0.0,
                        help="Zipf exponent of a synthetic router load per layer (default 0: uniform routing)")
    args = parser.parse_args()
    start = time.perf_counter()
    print_table(args.models, args.settings, args.gpus, args.microbatches, args.skew)
    print(f"(searched in {time.perf_counter() - start:.0f} s)")
    print_measured()


if __name__ == "__main__":
    main()
