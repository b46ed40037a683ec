"""Training throughput under frequent failures: plait's reconfiguration (Oobleck-style pipeline templates, f+1
heterogeneous pipelines, copies from surviving replicas) vs restart from the last checkpoint (Varuna-style) vs
replicas of one fixed template (torchft-style), with plait's simulator and analytic costs.

Setup (Oobleck, SOSP 2023, section 7; ../shared/REFERENCES.md section 2): ``N`` GPUs (one GPU per node: a failure
takes one rank), one failure every ``--interval`` seconds (default 10 minutes) until half the GPUs are gone, then
one more interval; the same victims (a seeded random order of the ranks) for every strategy. A fixed global batch
of ``--microbatches`` one-sample microbatches. Models: two of bench/pipeline_plans.py's nine MLLMs (every part
training, H100 costs, 90% of 80 GiB) and GPT-3 6.7B (2048 tokens per sample) for comparison with the paper.

Strategies (each iteration commits when it ends; work is counted in microbatches):

- **plait** (``plait.planner.resilience.templates`` + ``reconfigure``): templates for ``n0 .. N - f n0`` ranks from plait's
  search, the best instantiation with ``f + 1`` pipelines; on a failure, ``plan_reconfiguration`` (shrink,
  borrow, merge); the interrupted iteration is replayed, nothing else is lost; downtime = ``--reconfig-s``
  (detection, agreement, re-forming process groups) + the largest per-rank copy / ``--copy-gbps``. A failure that
  takes every copy of a unit falls back to a restart from the checkpoint (counted).
- **restart** (Varuna-style): the best homogeneous plan (``plan_layout``: DP x PP on the live GPUs); on a failure
  the work since the last completed checkpoint is lost and the job restarts on the survivors after
  ``--restart-s`` + loading its state.
- **fixed** (torchft-style): the best homogeneous plan on ``N`` GPUs; a replica that loses a rank idles for the
  rest of the run (no replacement node arrives), the others go on (the global batch shrinks with them) after
  ``--reconfig-s``; when no replica is left, a restart as above.

Under the default assumptions every strategy checkpoints on the same schedule and pays the same write stall (plait
too, although it only needs the checkpoint beyond ``f`` failures). Two sets of assumptions, both printed for every
row:

- **default** (ours): checkpoints at Young's interval ``sqrt(2 * write_s * MTBF)`` (J. W. Young, "A first order
  approximation to the optimum checkpoint interval", CACM 1974), the best interval for the failure rate, which
  favours restart; a write stalls training for (state bytes / live GPUs) / ``--ckpt-gbps`` (2 GB/s per GPU: an
  assumed parallel-file-system share, not a measurement); a restart costs ``--restart-s`` (120 s: an assumed
  relaunch, rendezvous and model build) plus reading the checkpoint at the same rate; plait and torchft-style
  reconfiguration ``--reconfig-s`` (10 s: Oobleck's simulator's figure for GPT-3 6.7B, below).
- **oobleck-sim**: the constants of the simulator behind Oobleck's throughput figures (SymbioticLab/Oobleck,
  ``tools/simulator/varuna_simulator.py`` and ``oobleck_simulator.py``, model ``GPT-3-6_7b``): Varuna restarts
  after a failure in 581 s (its rendezvous timeout of 701 s less the 120 s checkpoint it counts separately; the
  checkpoint read is inside), writes a checkpoint every 10 iterations of 1024 samples (here: every 10240 samples
  trained) stalling 120 s, and Oobleck reconfigures in 10 s and writes no checkpoint (so plait writes none under
  these settings; the torchft-style strategy checkpoints as Varuna). They were measured for GPT-3 6.7B on the
  paper's cluster; here the same seconds are applied to every model (not scaled to the MLLMs' sizes), so the MLLM
  rows under them are indicative only. Without checkpoints, a plait job that cannot keep ``f + 1`` pipelines and
  falls back to a restart (column ``reconf/restart``; e.g. ALM-M on 16 GPUs, ``n0 = 7``) loses all its work there,
  and when restart's rate is near zero the ratio says little: read such rows by their rates.

Approximations: iterations run at the planned time; checkpoint writes happen at iteration boundaries; the gradient
all-reduce of a shrunken torchft-style job keeps its initial time.

Run: ``.venv/bin/python bench/resilience.py`` (``--help``: GPU counts, models, interval, costs).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.pipeline_plans import DEVICE, DP_LINK, MEMORY_CAP, P2P, build  # noqa: E402
from plait.planner.cost.arch import DecoderArch, units_from_configs  # noqa: E402
from plait.planner.cost.analytic import unit_costs
from plait.planner.cost.types import MicrobatchShape  # noqa: E402
from plait.planner.resilience.reconfigure import plan_reconfiguration  # noqa: E402
from plait.planner.search.types import Machine  # noqa: E402
from plait.planner.search.layout import plan_layout  # noqa: E402
from plait.planner.resilience.templates import plan_instantiation, plan_templates
from plait.planner.resilience.types import TemplateSet  # noqa: E402

GPT3_6_7B = DecoderArch(hidden=4096, layers=32, heads=32, kv_heads=32, head_dim=128, intermediate=16384,
                        vocab=50257, gated_mlp=False, qkv_bias=True, o_bias=True, mlp_bias=True, norm_bias=True,
                        tied_embeddings=True)
GPT3_TOKENS = 2048


@dataclass(frozen=True)
class Costs:
    """The assumptions (seconds, bytes per second), under a label for the output."""

    label: str
    interval_s: float
    reconfig_s: float
    copy_Bps: float
    restart_s: float
    ckpt_Bps: float
    ckpt_every_s: float = 0.0  # 0: every ckpt_every_samples samples, or Young's interval
    ckpt_every_samples: int = 0  # > 0: a checkpoint every N samples trained
    ckpt_write_s: float = 0.0  # > 0: a fixed write stall (s) instead of state bytes / live GPUs / ckpt_Bps
    restart_reads: bool = True  # restart_s plus reading the checkpoint; False: restart_s is the whole downtime
    plait_checkpoints: bool = True  # False: plait writes no checkpoint (as Oobleck in its simulator)


OOBLECK_SIM = {"restart_s": 581.0, "ckpt_every_samples": 10 * 1024, "ckpt_write_s": 120.0, "restart_reads": False,
               "reconfig_s": 10.0, "plait_checkpoints": False}
"""GPT-3 6.7B in Oobleck's simulator (SymbioticLab/Oobleck tools/simulator/varuna_simulator.py: rendezvous 701 s
less the 120 s checkpointing overhead it counts separately, a checkpoint every ``checkpoint_per_iter = 10``
iterations of ``samples_per_step = 1024``; oobleck_simulator.py: reconfiguration 10 s and no checkpoints)."""


@dataclass
class Tally:
    """What one strategy achieved over the run."""

    work: float = 0.0  # committed microbatches
    reconfigs: int = 0
    restarts: int = 0
    down_s: list[float] = field(default_factory=list)
    copied_bytes: float = 0.0


def model_parts(name: str):
    """(units, costs) of a benchmark model, every part training."""
    if name == "GPT-3 6.7B":
        units = units_from_configs({"llm": GPT3_6_7B})
        shapes = {"llm": MicrobatchShape(tokens=GPT3_TOKENS, seq_len=GPT3_TOKENS)}
        return units, unit_costs(units, {"llm": GPT3_6_7B}, shapes, DEVICE)
    units, costs, _ = build(name, "trainable")
    return units, costs


def state_bytes(ts: TemplateSet) -> float:
    """Parameters plus optimizer state of the whole model (bytes): what a checkpoint holds."""
    return float(sum(u.param_bytes + u.state_bytes for u in ts.units))


def ckpt_plan(total_bytes: float, live: int, costs: Costs, rate: float) -> tuple[float, float]:
    """(checkpoint interval, write stall) in seconds on ``live`` GPUs writing in parallel, training ``rate``
    samples per second: the fixed interval, else every ``ckpt_every_samples`` samples, else Young's interval."""
    write = costs.ckpt_write_s or total_bytes / live / costs.ckpt_Bps
    every = costs.ckpt_every_s or costs.ckpt_every_samples / rate
    return every or math.sqrt(2 * write * costs.interval_s), write


def segment(duration: float, iteration_s: float, per_iteration: float, every: float, write: float
            ) -> tuple[float, float]:
    """Training for ``duration`` seconds with a checkpoint write of ``write`` s after every ``every`` s of
    training: (microbatches committed, microbatches covered by the last completed checkpoint)."""
    done = saved = 0.0
    t = 0.0
    while t < duration:
        train = min(every, duration - t)
        done += math.floor(train / iteration_s + 1e-9) * per_iteration
        t += train
        if t + write <= duration:
            saved = done
        t += write
    return done, saved


def restart_cost(total_bytes: float, live: int, costs: Costs) -> float:
    """Seconds a restart from the checkpoint takes: relaunch plus reading the state on ``live`` GPUs (or
    ``restart_s`` alone when it includes the read)."""
    return costs.restart_s + (total_bytes / live / costs.ckpt_Bps if costs.restart_reads else 0.0)


def failure_times(gpus: int, costs: Costs) -> list[float]:
    """One failure every interval until half the GPUs are gone."""
    return [costs.interval_s * (k + 1) for k in range(gpus // 2)]


class Homogeneous:
    """The best DP x PP plan (``plan_layout``) per live GPU count, cached."""

    def __init__(self, units, costs, microbatches: int) -> None:
        self.units, self.costs, self.microbatches = units, costs, microbatches
        self.cache: dict[int, object] = {}

    def plan(self, gpus: int):
        if gpus not in self.cache:
            self.cache[gpus] = plan_layout(self.units, self.costs, gpus, microbatches=self.microbatches,
                                           machine=Machine(memory_cap=MEMORY_CAP, p2p=P2P, dp_link=DP_LINK))
        return self.cache[gpus]


def run_restart(home: Homogeneous, gpus: int, victims: list[int], total: float, costs: Costs) -> Tally:
    """Varuna-style: restart on the survivors from the last checkpoint after every failure."""
    tally, t, live = Tally(), 0.0, gpus
    times = failure_times(gpus, costs) + [costs.interval_s * (gpus // 2 + 1)]
    for k, end in enumerate(times):
        choice = home.plan(live)
        every, write = ckpt_plan(total, live, costs, choice.microbatches / choice.iteration_s)
        done, saved = segment(end - t, choice.iteration_s, choice.microbatches, every, write)
        last = k == len(times) - 1
        tally.work += done if last else saved
        if not last:
            live -= 1
            down = restart_cost(total, live, costs)
            tally.restarts += 1
            tally.down_s.append(down)
            t = end + down
    return tally


def run_fixed(home: Homogeneous, gpus: int, victims: list[int], total: float, costs: Costs) -> Tally:
    """torchft-style: replicas of one plan; a replica with a lost rank idles; none left: restart."""
    tally, t = Tally(), 0.0
    alive = list(range(gpus))
    choice = home.plan(gpus)
    size = choice.plan.num_ranks
    replicas = {r: set(range(r * size, (r + 1) * size)) for r in range(choice.dp)}
    times = failure_times(gpus, costs) + [costs.interval_s * (gpus // 2 + 1)]
    for k, end in enumerate(times):
        per_replica = -(-choice.microbatches // choice.dp)
        every, write = ckpt_plan(total, len(alive), costs, per_replica * len(replicas) / choice.iteration_s)
        done, saved = segment(end - t, choice.iteration_s, per_replica * len(replicas), every, write)
        if k == len(times) - 1:
            tally.work += done
            break
        victim = victims[k]
        alive.remove(victim)
        hit = [r for r, ranks in replicas.items() if victim in ranks]
        for r in hit:
            del replicas[r]
        if replicas:
            tally.work += done
            down = costs.reconfig_s if hit else 0.0
            tally.reconfigs += bool(hit)
        else:  # every replica lost a rank: restart on the survivors with a new plan
            tally.work += saved
            choice = home.plan(len(alive))
            size = choice.plan.num_ranks
            replicas = {r: set(alive[r * size:(r + 1) * size]) for r in range(choice.dp)}
            down = restart_cost(total, len(alive), costs)
            tally.restarts += 1
        if down:
            tally.down_s.append(down)
        t = end + down
    return tally


def run_plait(ts: TemplateSet, gpus: int, victims: list[int], total: float, costs: Costs) -> Tally:
    """Oobleck-style: reconfigure the survivors' pipelines; restart only when a unit lost every copy."""
    tally, t = Tally(), 0.0
    inst = plan_instantiation(ts)
    times = failure_times(gpus, costs) + [costs.interval_s * (gpus // 2 + 1)]
    for k, end in enumerate(times):
        every, write = ckpt_plan(total, len(inst.ranks), costs, inst.microbatches / inst.iteration_s)
        if not costs.plait_checkpoints:
            every, write = math.inf, 0.0
        done, saved = segment(end - t, inst.iteration_s, inst.microbatches, every, write)
        if k == len(times) - 1:
            tally.work += done
            break
        try:
            rec = plan_reconfiguration(ts, inst, [victims[k]])
        except ValueError:
            alive = [r for r in inst.ranks if r != victims[k]]
            tally.work += saved
            inst = plan_instantiation(ts, alive, min_pipelines=max(1, min(ts.failures + 1,
                                                                          len(alive) // ts.min_ranks)))
            down = restart_cost(total, len(alive), costs)
            tally.restarts += 1
        else:
            tally.work += done
            received: dict[int, int] = {}
            for tr in rec.transfers:
                received[tr.dst] = received.get(tr.dst, 0) + tr.bytes
            down = costs.reconfig_s + max(received.values(), default=0) / costs.copy_Bps
            tally.reconfigs += 1
            tally.copied_bytes += rec.bytes
            inst = rec.after
        tally.down_s.append(down)
        t = end + down
    return tally


def templates_for(full: TemplateSet, gpus: int) -> TemplateSet:
    """The subset of ``full``'s templates a job of ``gpus`` GPUs uses (``n0 .. gpus - f n0``)."""
    top = gpus - full.failures * full.min_ranks
    chosen = tuple(t for t in full.templates if t.num_ranks <= top)
    return TemplateSet(gpus, full.failures, full.microbatches, chosen, full.units, full.dp_link)


def bench_model(name: str, gpu_counts: list[int], args: argparse.Namespace,
                settings: list[Costs]) -> dict[str, list[float]]:
    """Print one row per GPU count and set of assumptions; returns the plait/restart ratios by label."""
    units, unit_cost = model_parts(name)
    start = time.perf_counter()
    full = plan_templates(units, unit_cost, max(gpu_counts), args.failures, microbatches=args.microbatches,
                          machine=Machine(memory_cap=MEMORY_CAP, p2p=P2P, dp_link=DP_LINK))
    home = Homogeneous(units, unit_cost, args.microbatches)
    total = state_bytes(full)
    ratios: dict[str, list[float]] = {c.label: [] for c in settings}
    for gpus in gpu_counts:
        ts = templates_for(full, gpus)
        victims = random.Random(args.seed).sample(range(gpus), gpus // 2)
        clean = args.microbatches / plan_instantiation(ts).iteration_s
        for costs in settings:
            results = {"plait": run_plait(ts, gpus, victims, total, costs),
                       "restart": run_restart(home, gpus, victims, total, costs),
                       "fixed": run_fixed(home, gpus, victims, total, costs)}
            horizon = costs.interval_s * (gpus // 2 + 1)
            rate = {k: v.work / horizon for k, v in results.items()}
            ours = results["plait"]
            down = sum(ours.down_s) / len(ours.down_s) if ours.down_s else 0.0
            ratio = rate["plait"] / rate["restart"] if rate["restart"] else math.inf
            fixed_ratio = rate["plait"] / rate["fixed"] if rate["fixed"] else math.inf
            ratios[costs.label].append(ratio)
            print(f"{name:<11} {gpus:>4} {ts.min_ranks:>3} {clean:8.2f} {costs.label:<11} | {rate['plait']:8.2f} "
                  f"{rate['restart']:8.2f} {rate['fixed']:8.2f} | {ratio:7.2f}x {fixed_ratio:6.2f}x | "
                  f"{ours.reconfigs:>3}/{ours.restarts:<2} {down:6.1f} s {ours.copied_bytes / 2**30:8.1f} | "
                  f"{results['restart'].restarts:>3} {results['fixed'].reconfigs:>3}/{results['fixed'].restarts:<2}")
    print(f"  ({name}: templates and plans in {time.perf_counter() - start:.1f} s; checkpoint "
          f"{total / 2**30:.0f} GiB)")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--models", nargs="+", default=["VLM-S", "ALM-M", "GPT-3 6.7B"])
    parser.add_argument("--microbatches", type=int, default=128, help="one-sample microbatches per global batch")
    parser.add_argument("--failures", type=int, default=1, help="f: plait instantiates at least f + 1 pipelines")
    parser.add_argument("--interval", type=float, default=600.0, help="seconds between failures")
    parser.add_argument("--reconfig-s", type=float, default=10.0,
                        help="detection + agreement + process-group re-forming (s), plait and torchft-style "
                             "(default: Oobleck's simulator's 10 s for GPT-3 6.7B)")
    parser.add_argument("--copy-gbps", type=float, default=25.0, help="GB/s a rank receives copied state at")
    parser.add_argument("--restart-s", type=float, default=120.0,
                        help="relaunch of a restarted job before it reads its checkpoint (s; an assumption)")
    parser.add_argument("--ckpt-gbps", type=float, default=2.0,
                        help="GB/s each GPU writes / reads checkpoints at (an assumption)")
    parser.add_argument("--ckpt-every", type=float, default=0.0,
                        help="seconds of training between checkpoints (default 0: Young's interval for the rate)")
    parser.add_argument("--settings", nargs="+", default=["default", "oobleck-sim"],
                        choices=["default", "oobleck-sim"], help="sets of assumptions to report (module docstring)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    default = Costs("default", args.interval, args.reconfig_s, args.copy_gbps * 1e9, args.restart_s,
                    args.ckpt_gbps * 1e9, args.ckpt_every)
    sim = Costs("oobleck-sim", args.interval, copy_Bps=args.copy_gbps * 1e9, ckpt_Bps=args.ckpt_gbps * 1e9,
                **OOBLECK_SIM)
    settings = [{"default": default, "oobleck-sim": sim}[k] for k in args.settings]
    print(f"One failure every {args.interval:.0f} s until half the GPUs are gone, then one more interval; "
          f"global batch {args.microbatches} microbatches; f = {args.failures}.")
    print(f"Assumptions 'default': plait / torchft-style reconfiguration {args.reconfig_s:.0f} s + copies at "
          f"{args.copy_gbps:.0f} GB/s per receiving rank; restart {args.restart_s:.0f} s + checkpoint read; "
          f"checkpoint write/read {args.ckpt_gbps:.0f} GB/s per GPU, every "
          + (f"{args.ckpt_every:.0f} s" if args.ckpt_every else f"sqrt(2 x write x {args.interval:.0f} s) (Young)")
          + " of training for all three (restart 120 s and 2 GB/s are assumptions; reconfiguration 10 s is "
          "Oobleck's simulator's).")
    print(f"Assumptions 'oobleck-sim' (Oobleck's simulator, GPT-3 6.7B: SymbioticLab/Oobleck "
          f"tools/simulator): restart {OOBLECK_SIM['restart_s']:.0f} s including the checkpoint read; a "
          f"checkpoint every {OOBLECK_SIM['ckpt_every_samples']} samples stalling {OOBLECK_SIM['ckpt_write_s']:.0f} "
          f"s (restart and fixed; plait none, as Oobleck there); reconfiguration {OOBLECK_SIM['reconfig_s']:.0f} s "
          "+ copies; the same seconds for every model.")
    print("Throughput in microbatches (samples) per second over the whole run; 'no fail': plait's rate without "
          "failures.")
    header = (f"{'model':<11} {'GPUs':>4} {'n0':>3} {'no fail':>8} {'settings':<11} | {'plait':>8} {'restart':>8} "
              f"{'fixed':>8} | {'/restart':>8} {'/fixed':>7} | {'plait reconf/restart, mean down, GiB copied':<44} | "
              "restart: restarts; fixed: reconf/restarts")
    print(header)
    print("-" * len(header))
    for name in args.models:
        ratios = bench_model(name, args.gpus, args, settings)
        for label, values in ratios.items():
            print(f"  {name} ({label}): plait over restart "
                  + ", ".join(f"{g} GPUs {r:.1f}x" for g, r in zip(args.gpus, values)))


if __name__ == "__main__":
    main()
