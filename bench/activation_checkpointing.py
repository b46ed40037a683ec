"""Activation checkpointing: step time and saved-activation bytes of ``none`` / ``selective`` / ``full`` side by side.

For each model (the demo ``configs/demo.toml``; ``larger``: the demo job with a 8-layer 512-wide LLM and 6-layer
256-wide encoders, from config overrides), in one process:

1. build three single-process ``Trainer`` s of the job on its first ``--samples`` training records, identical but
   for ``train.activation_checkpointing`` (same seed, same weights);
2. **saved bytes**: one ``forward_backward`` of the global batch per policy, counting the distinct storages kept
   for the backward (real tensors, every microbatch of the step): what autograd saves
   (``torch.autograd.graph.saved_tensors_hooks``) plus what each checkpointed layer holds for its recomputation
   (its tensor arguments: input hidden states, masks; a forward pre-hook), parameters excluded (a matmul saves its
   weight: parameter memory, not an activation; the one counter, ``bench/tensor_bytes.py``), with the planner's
   prediction of the same ratio next to it (``planner.recompute.checkpointed_costs`` on the analytic unit costs);
3. **step time**: ``--steps`` optimizer steps per policy after one warm-up, interleaved (policy order rotated each
   round, so drifts in machine load hit every policy alike), median seconds;
4. print one table per model with ratios to ``none``.

Run: ``.venv/bin/python bench/activation_checkpointing.py [--models demo,larger] [--steps 4] [--samples 32]``
(about 2 minutes on the 2-core CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.plan_holds import small_train_set  # noqa: E402
from bench.tensor_bytes import saved_activation_bytes  # noqa: E402

POLICIES = ("none", "selective", "full")
LARGER = [
    '--model.llm.config={ model_type = "llama", hidden_size = 512, intermediate_size = 1536, num_hidden_layers = 8, '
    'num_attention_heads = 8, num_key_value_heads = 4, max_position_embeddings = 512, tie_word_embeddings = true }',
    '--model.encoders.vision.config={ model_type = "siglip_vision_model", hidden_size = 256, intermediate_size = 768, '
    'num_hidden_layers = 6, num_attention_heads = 4, image_size = 32, patch_size = 4, num_channels = 3 }',
]
MODELS = {"demo": [], "larger": LARGER}


def build(model: str, policy: str, folder: Path, samples: int, batch: int):
    """A single-process Trainer of the demo job (with ``model``'s overrides) under ``policy``."""
    from plait.config.loader import load_config
    from plait.train.trainer import Trainer

    overrides = [*MODELS[model], f"--train.activation_checkpointing={policy}", f"--train.global_batch_size={batch}",
                 f"--train.microbatch_size={batch // 2}", "--train.steps=100",
                 f"--metrics.run_dir={folder / f'run_{model}_{policy}'}"]
    cfg = load_config(ROOT / "configs" / "demo.toml", overrides)
    cfg.data.val = None
    cfg.data.train = str(small_train_set(ROOT / "data" / "demo" / "train.jsonl", samples, folder))
    return Trainer.build(cfg)


def saved_bytes(trainer, indices: list[int]) -> int:
    """Bytes kept for the backward over one forward/backward of ``indices`` (``bench.tensor_bytes``: what autograd
    saves plus a checkpointed layer's arguments, parameters excluded, each storage once)."""
    saved = saved_activation_bytes(trainer.model, lambda: trainer.forward_backward(indices))
    trainer.optimizer.zero_grad(set_to_none=True)
    return saved


def predicted_ratios(trainer) -> dict[str, float]:
    """The planner's saved-activation bytes of each policy over ``none`` for the trainer's model (analytic unit
    costs of a 1024-token microbatch; frozen-aware, the same unit choice as the runtime)."""
    from plait.models.plan_inputs import plan_configs
    from plait.models.units import model_units
    from plait.planner.cost.analytic import unit_activation_bytes, unit_costs
    from plait.planner.cost.types import DeviceSpec, MicrobatchShape
    from plait.planner.cost.recompute import checkpointed_costs, plan_checkpointing

    model = trainer.model
    units = model_units(model)
    configs = plan_configs({"llm": model.language_model.config,
                            **{n: b.encoder.config for n, b in model.encoders.items()}})
    costs = unit_costs(units, configs, MicrobatchShape(1024), DeviceSpec.cpu(), "fp32")
    totals = {p: sum(unit_activation_bytes(u, c) for u, c in
                     zip(units, checkpointed_costs(costs, plan_checkpointing(units, p)))) for p in POLICIES}
    return {p: totals[p] / totals["none"] for p in POLICIES}


def run_model(model: str, args: argparse.Namespace, folder: Path) -> None:
    trainers = {p: build(model, p, folder, args.samples, args.batch) for p in POLICIES}
    indices = list(range(args.batch))
    saved = {p: saved_bytes(t, indices) for p, t in trainers.items()}
    try:
        predicted = predicted_ratios(trainers["none"])
    except ValueError as exc:  # an encoder family without analytic costs
        predicted = {}
        print(f"(no planner prediction: {exc})")
    times: dict[str, list[float]] = {p: [] for p in POLICIES}
    for round_ in range(args.steps + 1):
        order = POLICIES[round_ % 3:] + POLICIES[:round_ % 3]
        for policy in order:
            start = time.perf_counter()
            trainers[policy].train_step(indices)
            if round_:  # the first round warms up
                times[policy].append(time.perf_counter() - start)
    params = sum(p.numel() for p in trainers["none"].model.parameters())
    print(f"\n{model}: {params / 1e6:.1f} M parameters, global batch {args.batch} (2 microbatches), "
          f"{args.steps} timed steps per policy, median")
    print(f"{'policy':<10} {'step s':>8} {'x none':>7} {'saved MiB':>10} {'x none':>7} {'planner x none':>15}")
    for p in POLICIES:
        step = statistics.median(times[p])
        base = statistics.median(times["none"])
        pred = f"{predicted[p]:.2f}" if predicted else "-"
        print(f"{p:<10} {step:>8.3f} {step / base:>7.2f} {saved[p] / 2**20:>10.1f} {saved[p] / saved['none']:>7.2f} "
              f"{pred:>15}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="demo,larger")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            run_model(model, args, Path(tmp))


if __name__ == "__main__":
    main()
