"""plait's V-shape zero-bubble schedule against PyTorch's: step time of ``zb_v`` vs ``ScheduleZBVZeroBubble``.

Both run the same 2-rank split of an LLM-only model (a Llama built from a config, fp32, eager attention): plait's
``plan_pipeline`` cuts the LLM's units (``embed_tokens``, ``layers.i``, ``norm``, ``lm_head``) into 4 stages placed
in a V (``plan.v_shape_ranks((), 2)``: stages on ranks 0, 1, 1, 0), and the torch side wraps the very same units
of each stage into a plain ``nn.Module`` (the HF decoder layers called with the rotary embeddings of the model's
``rotary_emb`` and the causal mask of ``transformers.masking_utils.create_causal_mask``) for
``torch.distributed.pipelining.PipelineStage``; rank ``r`` holds torch stages ``r`` and ``3 - r``. Both sides start
from the same weights (one seed, deep copies) and train on the same global batch of ``M`` microbatches with the
same loss: token cross-entropy sum / target tokens of the global batch (torch: ``scale_grads=False``).

One invocation spawns 2 gloo processes (one intra-op thread each). Each builds both pipelines, runs ``--warmup``
steps of each, then ``--repeats`` rounds of one plait step and one torch step (the order alternates per round, so
neither side always runs first after the other), each step between two barriers and timed on rank 0
(``time.perf_counter``); gradients are dropped after every step, no optimizer steps. The first step of each side
is checked against the other: loss (rank 0) and every gradient (both ranks), relative difference.

Prints the median step time of each side and the ratio plait / torch: below 1.0 plait's step is faster, above it
slower (target: <= 1.0). Both sides run in the same processes at the same time, so a drift of the machine's speed
reaches both alike; on shared cores the spread (min-max) says how much a single step can be trusted.
``--profile N`` adds N cProfile'd steps of each side on rank 0 after the timing and prints the top entries.

Measured on the 2-core CPU host (load 1.4-1.7, 2026-12-07): plait 674.9 ms, torch 677.2 ms, ratio 0.997 (per round
0.80-1.14); before the stage and split-``W`` changes of that day 1.046 on an idle machine.

Run: ``.venv/bin/python bench/zbv_vs_torch.py [--layers 6] [--hidden 256] [--seq 128]
[--microbatches 8] [--microbatch-size 1] [--vocab 8192] [--warmup 2] [--repeats 20] [--profile 0]``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import datetime
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble
from transformers.masking_utils import create_causal_mask

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.sim_vs_measured import run_ranks  # noqa: E402
from plait.data.collate import Batch  # noqa: E402
from plait.models.hf import build_causal_lm  # noqa: E402
from plait.models.multimodal import MultimodalModel  # noqa: E402
from plait.models.units import model_units  # noqa: E402
from plait.parallel.pipeline import build_pipeline_comm, run_pipeline_step  # noqa: E402
from plait.parallel.stages import build_rank_stages  # noqa: E402
from plait.planner.pipeline.plan import plan_pipeline, v_shape_ranks  # noqa: E402
from plait.planner.pipeline.schedules import build_schedule  # noqa: E402
from plait.train.loss import token_loss_sum  # noqa: E402

PP = 2


class TorchChunk(nn.Module):
    """The units of one plait stage as a plain module for ``PipelineStage``: token ids (first stage) or hidden
    states in, hidden states or logits (last stage) out. Every row is a whole sample without padding, so the
    positions are ``0..N-1`` and the mask is causal."""

    def __init__(self, model: MultimodalModel, units: tuple[str, ...], kinds: dict[str, str]) -> None:
        super().__init__()
        llm = model.language_model
        self.config, self.rotary = llm.config, llm.model.rotary_emb
        by_kind = {kind: [model.get_submodule(u) for u in units if kinds[u] == kind]
                   for kind in ("embed", "layer", "norm", "head")}
        self.embed = by_kind["embed"][0] if by_kind["embed"] else None
        self.layers = nn.ModuleList(by_kind["layer"])
        self.norm = by_kind["norm"][0] if by_kind["norm"] else nn.Identity()
        self.head = by_kind["head"][0] if by_kind["head"] else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x) if self.embed is not None else x
        if len(self.layers):
            b, n = hidden.shape[:2]
            positions = torch.arange(n).expand(b, n)
            mask = create_causal_mask(config=self.config, inputs_embeds=hidden,
                                      attention_mask=torch.ones(b, n, dtype=torch.long), cache=None,
                                      position_ids=positions)
            rope = self.rotary(hidden, position_ids=positions)
            for layer in self.layers:
                hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=positions)
        return self.head(self.norm(hidden))


def build_model(args: argparse.Namespace) -> MultimodalModel:
    """The LLM-only model (seed 0): a Llama of ``args.layers`` layers, width ``args.hidden``, untied head."""
    torch.manual_seed(0)
    config = dict(model_type="llama", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32,
                  num_key_value_heads=args.hidden // 64, max_position_embeddings=max(512, args.seq),
                  tie_word_embeddings=False)
    llm = build_causal_lm(config=config, vocab_size=args.vocab, attn_implementation="eager")
    return MultimodalModel(llm, {}, {})


def global_batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels ``[M * b, N]`` (seed 1); the last position of each row has no label."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args.vocab, (args.microbatches * args.microbatch_size, args.seq), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    return ids, labels


def _text_batch(ids: torch.Tensor, labels: torch.Tensor) -> Batch:
    """A plait ``Batch`` of whole text rows (no padding, no media)."""
    ones, zeros = torch.ones_like(ids), torch.zeros_like(ids)
    return Batch(ids, labels, ones, torch.arange(ids.shape[1]).expand_as(ids).clone(), zeros, zeros - 1, {}, ())


def _grad_diff(plait_params: list[tuple[str, nn.Parameter]], torch_model: nn.Module) -> float:
    """Largest |plait grad - torch grad| / max|torch grad| over this rank's parameters."""
    worst = 0.0
    for name, p in plait_params:
        ref = torch_model.get_parameter(name).grad
        worst = max(worst, float((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
    return worst


def _worker(rank: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    """One rank: build both pipelines, check their first steps against each other, time interleaved steps."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=PP,
                            timeout=datetime.timedelta(seconds=300))
    try:
        model = build_model(args)
        torch_model = copy.deepcopy(model)  # before build_rank_stages prunes ``model`` to this rank's units
        units = model_units(model)
        plan = plan_pipeline(units, "encoder_parallel", stages_per_module={"llm": 2 * PP}, ranks=v_shape_ranks((), PP))
        comm = build_pipeline_comm(PP)
        stages = build_rank_stages(model, plan, comm.pp_rank)
        m = args.microbatches
        schedule = build_schedule(plan, "zb_v", m)
        ids, labels = global_batch(args)
        b = args.microbatch_size
        batches = [_text_batch(ids[i * b:(i + 1) * b], labels[i * b:(i + 1) * b]) for i in range(m)]
        targets = int((labels != -100).sum())

        kinds = {u.name: u.kind for u in units}
        mine = [s for s in plan.stages if s.rank == rank]  # stage r and stage 3 - r
        torch_stages = [PipelineStage(TorchChunk(torch_model, s.units, kinds), s.index, plan.num_stages,
                                      torch.device("cpu")) for s in mine]
        torch_schedule = ScheduleZBVZeroBubble(torch_stages, m, loss_fn=lambda out, tgt: token_loss_sum(out, tgt)
                                               / targets, scale_grads=False)
        plait_params = stages.trainable_parameters()
        torch_params = [p for s in torch_stages for p in s.submod.parameters()]

        def plait_step() -> float:
            return run_pipeline_step(stages, schedule, batches, targets, comm, loss_fn=token_loss_sum).loss

        def torch_step() -> float:
            losses: list[torch.Tensor] = []
            if rank == 0:  # rank 0 holds the first stage (inputs) and the last (targets, losses)
                torch_schedule.step(ids, target=labels, losses=losses)
            else:
                torch_schedule.step()
            return float(sum(losses)) if losses else float("nan")

        def timed(step) -> tuple[float, float]:
            dist.barrier()
            start, cpu = time.perf_counter(), time.thread_time()
            step()
            cpu = time.thread_time() - cpu  # before the barrier: this rank's own work and waits only
            dist.barrier()
            return time.perf_counter() - start, cpu

        def drop_grads() -> None:
            for p in [p for _, p in plait_params] + torch_params:
                p.grad = None

        first = {"plait": plait_step(), "torch": torch_step()}
        first["grad_rel_diff"], first["grads"] = _grad_diff(plait_params, torch_model), len(plait_params)
        drop_grads()
        for _ in range(args.warmup):
            plait_step(), torch_step()
            drop_grads()
        times: dict[str, list[float]] = {"plait": [], "torch": []}
        cpus: dict[str, list[float]] = {"plait": [], "torch": []}
        for r in range(args.repeats):
            order = (("plait", plait_step), ("torch", torch_step))
            for name, step in order if r % 2 == 0 else order[::-1]:
                wall, cpu = timed(step)
                times[name].append(wall)
                cpus[name].append(cpu)
                drop_grads()
        profiles = {}
        for name, step in (("plait", plait_step), ("torch", torch_step)) if args.profile else ():
            prof = cProfile.Profile()  # both ranks run the same steps in the same order; rank 0 reports
            for _ in range(args.profile):
                prof.runcall(step)
                drop_grads()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.profile_top)
            profiles[name] = text.getvalue()
        stage_units = [[u.split(".")[-2] + "." + u.split(".")[-1] if ".layers." in u else u.split(".")[-1]
                        for u in s.units] for s in plan.stages]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
            {"first": first, "times": times, "cpu": cpus, "profiles": profiles, "stages": stage_units}))
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace, limit_s: float = 900.0) -> list[dict]:
    """Run the two workers; each rank's result dict (first-step losses and gradient difference, step times)."""
    return run_ranks(_worker, lambda port, folder: (port, args, folder), PP, limit_s, "benchmark")


def report(args: argparse.Namespace, ranks: list[dict]) -> float:
    """Print the split, the first-step check and the timing table; returns the ratio plait / torch."""
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32, eager attention; "
          f"M = {args.microbatches} microbatches of {args.microbatch_size} x {args.seq} tokens; gloo, 2 processes, "
          f"1 thread each; load average before {os.getloadavg()[0]:.2f}")
    for i, units in enumerate(ranks[0]["stages"]):
        print(f"  stage {i} on rank {v_shape_ranks((), PP)[i]}: {', '.join(units)}")
    first = ranks[0]["first"]
    rel = abs(first["plait"] - first["torch"]) / abs(first["torch"])
    grad = max(r["first"]["grad_rel_diff"] for r in ranks)
    print(f"\nfirst step: loss plait {first['plait']:.8f}  torch {first['torch']:.8f}  relative difference "
          f"{rel:.2e}; largest |gradient difference| / max|gradient| over the "
          f"{sum(r['first']['grads'] for r in ranks)} parameters of both ranks {grad:.2e}")
    if rel > 1e-5 or grad > 1e-4:
        print("  MISMATCH: the two pipelines do not compute the same step")
    times = ranks[0]["times"]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{'schedule':<34}{'median ms':>10}{'min ms':>9}{'max ms':>9}{'CPU ms r0':>11}{'CPU ms r1':>11}"
          f"   ({args.repeats} steps each, interleaved)")
    for name, label in (("plait", "plait zb_v (run_pipeline_step)"), ("torch", "torch ScheduleZBVZeroBubble")):
        v, cpu = times[name], [1e3 * statistics.median(r["cpu"][name]) for r in ranks]
        print(f"{label:<34}{1e3 * med[name]:>10.1f}{1e3 * min(v):>9.1f}{1e3 * max(v):>9.1f}{cpu[0]:>11.1f}"
              f"{cpu[1]:>11.1f}")
    print("(step: wall time between barriers on rank 0; CPU: median main-thread CPU time of a step per rank)")
    ratio = med["plait"] / med["torch"]
    per_round = [p / t for p, t in zip(times["plait"], times["torch"])]
    print(f"\nratio plait / torch (median step): {ratio:.3f}   per round: min {min(per_round):.3f} median "
          f"{statistics.median(per_round):.3f} max {max(per_round):.3f}   target <= 1.0: "
          f"{'met' if ratio <= 1.0 else 'NOT met'}")
    for name, text in ranks[0]["profiles"].items():
        print(f"\n----- cProfile of {args.profile} {name} steps on rank 0 (by own time) -----\n{text.strip()}")
    return ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6, help="LLM layers (cut with embed, norm, head into 4 stages)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (heads of 32, 2 query heads per KV)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128, help="tokens per row")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=1, help="rows per microbatch")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each side after the checked one")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds (one step of each side per round)")
    parser.add_argument("--profile", type=int, default=0, help="cProfile'd steps of each side on rank 0 (0: none)")
    parser.add_argument("--profile-top", type=int, default=25, help="entries printed per profile")
    args = parser.parse_args(argv)
    if args.hidden % 64:
        parser.error("--hidden must be a multiple of 64 (heads of 32, 2 query heads per KV head)")
    report(args, measure(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
