"""Command line: argument parsing only; each verb calls one function of ``plait.commands.<verb>``.

``plait train --config configs/demo.toml [--section.key=value ...] [--resume]``: train a job.
``plait plan --config configs/demo.toml --devices 8 [--out plan.json]``: choose a layout and partition with
the analytic, frozen-aware cost model and print it.
``plait simulate --plan plan.json --out-dir DIR``: the predicted timeline of a plan (Chrome trace + PNG).
``plait profile --config configs/demo.toml [--out profile.json]``: measure per-unit costs of the job's model
on this machine (reusing a stored profile only when model, shapes, dtype, device and versions all match).
``plait generate --model runs/demo/final (--prompt TEXT [--image P] [--audio P] | --input F --output F)``: greedy
answers of a trained model, printed or written as JSONL predictions.
``plait tune-ranks --config job.toml [--ranks 2,4,8,16] [--budget N]``: choose a LoRA rank per module (MARS).
``plait energy --config job.toml --devices N [--straggler 1.2] [--gpu h100]``: the time-energy frontier of the job's
plan and a GPU frequency per action (Perseus): table, frontier plot and frequency plan JSON.
``plait launch --config job.toml --nproc N [--f 1]``: resilient training that survives worker failures in place.
``plait import --from HF_FOLDER --out DIR``: a Hugging Face LLaVA / Qwen2-Audio / Qwen2.5-VL / Gemma 3 / Qwen3-VL /
Qwen2.5-Omni thinker / Voxtral checkpoint as a plait model and job.
``plait export --run RUN --format FORMAT [--out DIR]`` (``EXPORT_FORMATS``): a trained model back as that Hugging Face
class.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import sys
from typing import Sequence

__all__ = ["build_parser", "check_job_arguments", "main", "parse_command_line"]


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from plait.commands.train import train_command

    return train_command(args.config, overrides, resume=args.resume, profile_store=args.profile_store,
                         overwrite=args.overwrite)


def _plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from plait.commands.plan.command import plan_command

    if args.energy is not None:
        from plait.commands.plan.energy import plan_by_energy

        plan_by_energy(args.config, args.devices, tolerance=args.energy, gpu=args.device, out_json=args.out,
                       overrides=overrides, microbatches=args.microbatches, frozen_aware=not args.frozen_unaware,
                       encoder_dp=args.encoder_dp, encoder_tp=args.encoder_tp, gpus_per_node=args.gpus_per_node,
                       dp_degrees=None if args.dp is None else [args.dp])
        return 0
    plan_command(args.config, args.devices, args.out, overrides=overrides, device=args.device,
                 microbatches=args.microbatches, frozen_aware=not args.frozen_unaware,
                 macrobatches=args.macrobatches, dp_degrees=None if args.dp is None else [args.dp],
                 memory_fraction=args.memory_fraction, schedules=args.schedules, gpus_per_node=args.gpus_per_node,
                 encoder_dp=args.encoder_dp, encoder_tp=args.encoder_tp,
                 **({"virtual_stages": (1,), "attach_encoders": False, "in_bubble": False}
                    if args.one_stage_per_rank else {}))
    return 0


def _schedule_list(text: str) -> tuple[str, ...]:
    """``--schedules``: comma-separated schedule names (checked by the plan command)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _simulate(args: argparse.Namespace, overrides: list[str]) -> int:
    from plait.commands.simulate import simulate_command

    simulate_command(args.plan, args.out_dir)
    return 0


def _profile(args: argparse.Namespace, overrides: list[str]) -> int:
    from plait.commands.profile import profile_command

    profile_command(args.config, overrides, store=args.store, out_path=args.out, microbatches=args.microbatches,
                    microbatch_size=args.microbatch_size, repeats=args.repeats, warmup=args.warmup,
                    clock=args.clock, force=args.force, energy=args.energy, clocks=args.clocks)
    return 0


def _generate(args: argparse.Namespace, overrides: list[str]) -> int:
    from plait.commands.generate import generate_command

    return generate_command(args.model, prompt=args.prompt, images=args.image, audios=args.audio, videos=args.video,
                            input_path=args.input, output_path=args.output, max_new_tokens=args.max_new_tokens,
                            batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                            threads=args.threads)


def _tune_ranks(args: argparse.Namespace, overrides: list[str]) -> int:
    from plait.commands.train import train_command
    from plait.commands.tune_ranks import SearchSettings, tune_ranks_command

    def ints(text: str, flag: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None

    settings = SearchSettings(ranks=ints(args.ranks, "--ranks"), sizes=ints(args.sizes, "--sizes"), epochs=args.epochs,
                              batch=args.batch, val_samples=args.val_samples, tolerance=args.tolerance,
                              budget=args.budget, nproc=args.nproc)
    tune_ranks_command(args.config, overrides, settings, args.out_dir, train=train_command)
    return 0


def _energy(args: argparse.Namespace, overrides: list[str]) -> int:
    from plait.commands.plan.energy import energy_command

    energy_command(args.config, args.devices, straggler=args.straggler, gpu=args.gpu, out_dir=args.out_dir,
                   overrides=overrides, microbatches=args.microbatches, method=args.method,
                   energy_profile=args.energy_profile, dp_degrees=None if args.dp is None else [args.dp],
                   encoder_dp=args.encoder_dp, encoder_tp=args.encoder_tp)
    return 0


def _import(args: argparse.Namespace, overrides: list[str]) -> int:
    from plait.commands.import_hf import import_command

    return import_command(args.source, args.out, train=args.train, val=args.val, chat_template=args.chat_template)


def _export(args: argparse.Namespace, overrides: list[str]) -> int:
    from plait.commands.export_hf import export_command

    return export_command(args.run, args.format, args.out)


OVERRIDES_HELP = """overrides:
  Any field of the job file can be set on the command line as --<section>.<field>=<value>, after the
  options, e.g.  --train.lr=1e-3  --train.steps=200  --parallel.pp.degree=2  --data.val=  (empty: off).
  Values are parsed as TOML (numbers, true/false, [lists], "strings"; bare words are strings); the
  section path follows the job file ([model.encoders.vision] -> --model.encoders.vision.freeze=true).
  Overrides are applied after the file is read and validated together with it; every field is
  documented in plait/config/schema.py."""


EXPORT_FORMATS = ("llava", "qwen2_audio", "qwen2_5_vl", "gemma3", "qwen3_vl", "qwen2_5_omni", "voxtral",
                  "qwen3_vl_moe", "qwen3_omni_moe")
"""``plait export --format`` choices: the keys of ``plait.models.hf_io.HF_FORMATS`` (kept here so that parsing loads
no model code; a test holds them equal)."""


def _launch(args: argparse.Namespace, overrides: list[str]) -> int:
    from plait.commands.launch import NodeRole, launch_command, worker_main

    if args.worker is not None:  # one worker process, started by the launcher
        return worker_main(args.config, overrides, args.worker, args.nproc, args.store, args.joining)
    sizes = [int(n) for n in args.pipelines.split(",")] if args.pipelines else []
    node = NodeRole(args.nnodes, args.node_rank, args.store)
    return launch_command(args.config, args.nproc, args.f, overrides, sizes, args.kill, args.timeout,
                          rejoins=args.rejoin, overwrite=args.overwrite, device=args.device, node=node,
                          hang_s=args.hang_timeout or None, stops=args.stop, node_kills=args.kill_node)


_JOB_VERBS = {"train": False, "profile": False, "tune-ranks": False, "launch": False, "plan": True, "energy": True}
"""The verbs that read a ``--config`` job file, checked before the verb's module is imported: True for the verbs
that read it for planning (their ``[parallel.pp]`` table and ``parallel.dp`` replaced by the plan). The other verbs
read no job file, so take no ``--section.key=value`` overrides."""


def build_parser() -> argparse.ArgumentParser:
    """The ``plait`` parser with one subparser per verb (options matched by their full name only)."""
    parser = argparse.ArgumentParser(prog="plait", description="Train multimodal LLMs composed of Hugging Face parts.",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ExactParser)
    train = sub.add_parser(
        "train", help="train a job (single process, or under torchrun for DP/CP/PP)",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=OVERRIDES_HELP)
    train.add_argument("--config", required=True, help="TOML job file, e.g. configs/demo.toml")
    train.add_argument("--resume", nargs="?", const=True, default=False,
                       help="resume from the newest checkpoint of the run (or from the given directory); a larger "
                            "--train.steps extends the run, its LR cosine re-stretched without a jump")
    train.add_argument("--overwrite", action="store_true",
                       help="start a new run even when metrics.run_dir (default: runs/<job file name>) holds an "
                            "earlier run's checkpoints or final model: they are removed (without it, refused)")
    train.add_argument("--profile-store", default="runs/profiles",
                       help="folder of stored profiles for parallel.plan=auto")
    plan = sub.add_parser("plan", help="choose a pipeline layout/partition for N devices (analytic costs)",
                          formatter_class=argparse.RawDescriptionHelpFormatter, epilog=OVERRIDES_HELP)
    plan.add_argument("--config", required=True, help="TOML job file (its [model] section is planned; its "
                      "[parallel.pp] table and parallel.dp are replaced by the plan, not checked)")
    plan.add_argument("--devices", type=int, required=True,
                      help="devices to plan for (GPUs, or CPU processes with --device cpu)")
    plan.add_argument("--out", default=None, help="write the chosen plan as JSON here")
    plan.add_argument("--device", default=None, help="device: h100, h200, a100 (presets), cpu (this host's CPU, "
                      "measured) or cpu-preset (a fixed CPU preset); default: this host's GPU, else its CPU")
    plan.add_argument("--microbatches", type=int, default=None,
                      help="split the job's global batch (train.global_batch_size samples) into N microbatches of "
                           "ceil(global / N) samples, as parallel.pp.microbatches does; at most the global batch "
                           "size (default: global_batch_size / microbatch_size)")
    plan.add_argument("--frozen-unaware", action="store_true", help="plan with backward = 2x forward everywhere")
    plan.add_argument("--dp", type=int, default=None,
                      help="data-parallel degree to plan for, at most --devices and the microbatches per step "
                           "(default: searched); the printed [parallel.pp] table is one replica's, with the "
                           "parallel.dp to set in [parallel]")
    plan.add_argument("--one-stage-per-rank", action="store_true",
                      help="only plans of one stage per rank (no interleaved 1F1B, no encoders on the first LLM rank)")
    plan.add_argument("--schedules", type=_schedule_list, default=("1f1b",), metavar="NAMES",
                      help="comma-separated schedules weighed for plans of one stage per rank: 1f1b, zb_h1, zb_h2 "
                           "(zero-bubble: weight gradients in the bubbles; zb_h2 holds about twice the activations), "
                           "and zb_v (that plan's LLM cut into two stages per rank placed in a V, at 1F1B's "
                           "activation memory); the fastest that fits memory is planned (default: 1f1b)")
    plan.add_argument("--encoder-dp", action=argparse.BooleanOptionalAction, default=True,
                      help="search a data-parallel degree per encoder branch (its stages replicated on up to "
                           "train.microbatch_size ranks, each encoding a share of every microbatch's samples; "
                           "written as [parallel.pp] encoder_dp); on by default, --no-encoder-dp: one replica "
                           "per encoder stage")
    plan.add_argument("--encoder-tp", action="store_true",
                      help="also search a tensor-parallel degree per encoder branch (each of its stages a TP group "
                           "on ranks of its own, up to the largest power of two dividing the tower's heads; written "
                           "as [parallel.pp] encoder_tp)")
    plan.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                      help="plan for nodes of N GPUs (NVLink inside a node, 400 Gb/s InfiniBand per GPU between "
                           "nodes): each collective is charged by where its group sits, and the rank order that "
                           "keeps the heavy groups inside nodes is written as parallel.rank_order (N >= 1; default: "
                           "one node)")
    plan.add_argument("--energy", type=float, nargs="?", const=0.02, default=None, metavar="TOLERANCE",
                      help="among the best plans of every DP degree and layout within TOLERANCE (default 0.02 = 2%%) "
                           "of the fastest iteration, choose the least energy per iteration (plait energy's frontier "
                           "at T*, --device's GPU preset, h100 by default)")
    plan.add_argument("--memory-fraction", type=float, default=0.9,
                      help="fraction of each device's memory a stage may use (the memory cap; the rest: CUDA context, "
                           "workspaces); when no plain plan fits it, tp, dp_shard and activation checkpointing are "
                           "searched (default 0.9)")
    plan.add_argument("--macrobatches", type=int, default=0,
                      help="sample N global batches from data.train: report how module totals vary and plan for "
                           "the expected batch (processes the training set; e.g. 32)")
    simulate = sub.add_parser("simulate", help="predicted timeline (Chrome trace + PNG) of a plan JSON")
    simulate.add_argument("--plan", required=True, help="plan JSON written by `plait plan --out` (not a profile "
                          "or a timeline.json)")
    simulate.add_argument("--out-dir", required=True, help="folder for timeline.json and timeline.png")
    profile = sub.add_parser("profile", help="measure per-unit costs of the job's model on this machine")
    profile.add_argument("--config", required=True, help="TOML job file (its model and first training samples)")
    profile.add_argument("--out", default=None, help="profile JSON file (default: <store>/profile-<key hash>.json); "
                         "an existing file is replaced only when it is a plait profile")
    profile.add_argument("--store", default="runs/profiles", help="folder of stored profiles")
    profile.add_argument("--microbatches", type=int, default=1, help="microbatches to profile (costs are their mean)")
    profile.add_argument("--microbatch-size", type=int, default=None, help="samples per microbatch "
                         "(default: train.microbatch_size)")
    profile.add_argument("--repeats", type=int, default=5, help="timed repetitions per measurement (median)")
    profile.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    profile.add_argument("--clock", choices=("wall", "thread"), default="wall",
                         help="wall: elapsed time; thread: CPU time of the thread (CPU, 1 thread, shared machines)")
    profile.add_argument("--force", action="store_true", help="measure even when a matching profile is stored")
    profile.add_argument("--energy", action="store_true", help="also sweep the GPU's SM clocks and store the measured "
                         "energy profile (NVML through zeus: pip install -e \".[energy]\"; locking clocks needs "
                         "SYS_ADMIN; skipped with the reason otherwise)")
    profile.add_argument("--clocks", type=int, default=5, help="SM clocks of the --energy sweep (from the top down "
                         "to half of it)")
    generate = sub.add_parser("generate", help="greedy answers of a trained model (<run_dir>/final) to a prompt or "
                              "a JSONL file")
    generate.add_argument("--model", required=True, help="the folder plait train writes, e.g. runs/demo/final")
    generate.add_argument("--prompt", default=None, help="the user's message; one <image>/<audio> placeholder per "
                          "item is put before it unless it has them")
    generate.add_argument("--image", action="append", default=[], help="an image file (repeat for several)")
    generate.add_argument("--audio", action="append", default=[], help="an audio file (repeat for several)")
    generate.add_argument("--video", action="append", default=[],
                          help="a video file (repeat for several), sampled as in training; for a model whose image "
                               "branch takes videos")
    generate.add_argument("--input", default=None, help="JSONL records in plait's data format to answer "
                          "(an assistant answer at the end is the reference)")
    generate.add_argument("--output", default=None, help="JSONL predictions (id, task, prompt, prediction, reference)")
    generate.add_argument("--max-new-tokens", type=int, default=16, help="at most this many tokens per answer")
    generate.add_argument("--batch-size", type=int, default=16, help="prompts per forward pass")
    generate.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda, cuda:1")
    generate.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                          help="auto: bf16 autocast on CUDA, fp32 on CPU (as training's validation with train.dtype "
                               "= auto)")
    generate.add_argument("--threads", type=int, default=None,
                          help="torch's intra-op CPU threads, as train.threads (default or 0: this host's free cores, from "
                               "its load; torch's own default, one per core, crawls on a shared CPU)")
    tune = sub.add_parser("tune-ranks", help="choose a LoRA rank per module (MARS): short calibration runs, laws, "
                          "pruning; prints the [model.*.lora] tables", formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog=OVERRIDES_HELP)
    tune.add_argument("--config", required=True, help="TOML job file with LoRA on the LLM and on at least one encoder "
                      "(r > 0; the value is replaced by the candidates) and a data.val")
    tune.add_argument("--ranks", default="2,4,8,16", help="candidate ranks of every module, comma-separated")
    tune.add_argument("--sizes", default="", help="data-subset sizes in samples, comma-separated (default: 1/8 and "
                      "1/4 of data.train)")
    tune.add_argument("--epochs", type=float, default=1.0, help="passes over each subset per calibration run")
    tune.add_argument("--batch", type=int, default=0, help="global batch of the calibration runs (default: the job's)")
    tune.add_argument("--val-samples", type=int, default=64, help="validation records each calibration run scores")
    tune.add_argument("--tolerance", type=float, default=1.5,
                      help="largest accepted ratio of an encoder's to the LLM's predicted convergence time")
    tune.add_argument("--budget", type=int, default=None, help="most training samples all calibration runs together "
                      "may process (the largest subset sizes are dropped to fit)")
    tune.add_argument("--nproc", type=int, default=1, help="processes per calibration run (> 1: torchrun, for the "
                      "job's parallel layout)")
    tune.add_argument("--out-dir", default=None, help="folder of the search (default: <metrics.run_dir>/tune_ranks); "
                      "finished runs found there are not run again")
    energy = sub.add_parser("energy", help="time-energy frontier of the job's plan and a GPU frequency per action "
                            "(Perseus): table, plot, frequency plan JSON", formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=OVERRIDES_HELP)
    energy.add_argument("--config", required=True, help="TOML job file (planned as by plait plan)")
    energy.add_argument("--devices", type=int, required=True, help="GPUs to plan for")
    energy.add_argument("--straggler", type=float, default=1.2,
                        help="another replica's iteration time as a multiple of the fastest (plans that point too)")
    energy.add_argument("--gpu", default="h100", choices=("a100", "h100", "h200"), help="GPU power preset")
    energy.add_argument("--out-dir", default=None, help="folder for energy_plan.json, frontier.json/.png and "
                        "timelines.png (default: runs/<job file stem>/energy)")
    energy.add_argument("--microbatches", type=int, default=None, help="as plait plan --microbatches")
    energy.add_argument("--dp", type=int, default=None, help="as plait plan --dp (--dp 1: one pipeline over the "
                        "devices; a frequency plan needs a pipeline)")
    energy.add_argument("--energy-profile", default=None, help="measured energy profile JSON (plait profile --energy, "
                        "runs/profiles/energy-profile-<key>.json) instead of the --gpu preset")
    energy.add_argument("--encoder-dp", action=argparse.BooleanOptionalAction, default=True,
                        help="as plait plan --encoder-dp, on by default (replicated encoder stages; each replica's "
                        "actions get their own clocks); --no-encoder-dp: one replica per encoder stage")
    energy.add_argument("--encoder-tp", action="store_true",
                        help="as plait plan --encoder-tp (tensor-parallel encoder stages; each TP rank's actions get "
                        "their own clocks)")
    energy.add_argument("--method", choices=("auto", "exact", "lowtime"), default="auto",
                        help="frontier solver: lowtime (Phillips-Dessouky), exact (MILP per point, small DAGs) or "
                             "auto (exact when small)")
    launch = sub.add_parser("launch", help="resilient training: N worker processes as heterogeneous pipelines that "
                            "survive worker failures (Oobleck) without a restart", epilog=OVERRIDES_HELP)
    launch.add_argument("--config", required=True, help="TOML job file")
    launch.add_argument("--nproc", type=int, required=True, help="worker processes")
    launch.add_argument("--f", type=int, default=1, help="simultaneous failures to survive (f+1 pipelines at least)")
    launch.add_argument("--pipelines", default="", help="first pipelines' sizes in worker order, e.g. 3,3 "
                        "(default: the fastest predicted instantiation)")
    launch.add_argument("--timeout", type=float, default=10.0, help="collective timeout in seconds (a hung peer "
                        "is declared failed after it)")
    launch.add_argument("--kill", action="append", default=[], metavar="WORKER:STEP",
                        help="fault injection for tests: that worker SIGKILLs itself in the middle of that step")
    launch.add_argument("--rejoin", action="append", default=[], metavar="WORKER:STEP", help="restart that worker "
                        "once it died; the job admits it at the start of that step and re-instantiates")
    launch.add_argument("--overwrite", action="store_true", help="start a new run even when metrics.run_dir holds "
                        "an earlier run's checkpoints, final model or launch logs: they are removed (else refused)")
    launch.add_argument("--device", default=None, help="device preset to plan the pipelines for: h100, h200, a100 "
                        "or cpu (default: this host's CPU measured, which the workers train on)")
    launch.add_argument("--nnodes", type=int, default=1, help="nodes of the job: one plait launch per node, each "
                        "with --nproc workers (numbered node by node); --f then counts nodes")
    launch.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0..nnodes-1 (node 0 plans the "
                        "job and hosts the membership store)")
    launch.add_argument("--store", default="", metavar="HOST:PORT", help="the membership store: node 0 hosts it on "
                        "that port, every node's launcher and workers connect to it (needed with --nnodes > 1)")
    launch.add_argument("--hang-timeout", type=float, default=60.0, metavar="SECONDS", help="a worker without a "
                        "heartbeat for this long while its process lives is killed as hung and replaced like a "
                        "dead one (0: never)")
    launch.add_argument("--stop", action="append", default=[], metavar="WORKER:STEP",
                        help="fault injection for tests: that worker SIGSTOPs itself (hangs) in the middle of that step")
    launch.add_argument("--kill-node", action="append", default=[], metavar="NODE:STEP", help="fault injection for "
                        "tests: that node's launcher and all its workers are SIGKILLed at once in the middle of that step")
    launch.add_argument("--joining", action="store_true", help=argparse.SUPPRESS)
    launch.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    formats = ", ".join(EXPORT_FORMATS)
    about = (f"a local Hugging Face checkpoint of any format plait export writes ({formats}) as a plait model and a "
             "job that fine-tunes it")
    imp = sub.add_parser("import", help=about, description=about)
    imp.add_argument("--from", dest="source", required=True, help=f"the checkpoint folder with its processor and "
                     f"tokenizer files; its config.json model_type one of {formats} (a full Qwen2.5-Omni or "
                     "Qwen3-Omni-MoE checkpoint: its thinker; the classes are listed under plait export --format)")
    imp.add_argument("--out", required=True, help="folder for model/ (plait's final/ layout) and job.toml")
    imp.add_argument("--train", default="", help="the job's data.train (default: <out>/train.jsonl, to be written)")
    imp.add_argument("--val", default="", help="the job's data.val (default: none)")
    imp.add_argument("--chat-template", default="", help="a Jinja file or committed template name, for a checkpoint "
                     "without a chat template")
    exp = sub.add_parser("export", help=f"a trained plait model as a Hugging Face checkpoint ({formats}) with its "
                         "processor")
    exp.add_argument("--run", required=True, help="the run folder (its final/) or a final/ folder")
    exp.add_argument("--format", required=True, choices=EXPORT_FORMATS,
                     help="llava: LlavaForConditionalGeneration; qwen2_audio: Qwen2AudioForConditionalGeneration; "
                          "qwen2_5_vl: Qwen2_5_VLForConditionalGeneration (projector folded into the merger); "
                          "gemma3: Gemma3ForConditionalGeneration; qwen3_vl: Qwen3VLForConditionalGeneration; "
                          "qwen2_5_omni: Qwen2_5OmniThinkerForConditionalGeneration (projectors folded into the "
                          "towers); voxtral: VoxtralForConditionalGeneration (the projector folded into the tower's "
                          "projector); qwen3_vl_moe: Qwen3VLMoeForConditionalGeneration; qwen3_omni_moe: "
                          "Qwen3OmniMoeThinkerForConditionalGeneration")
    exp.add_argument("--out", default=None, help="the checkpoint folder (default: <run>/hf-<format>)")
    return parser


_OVERRIDE = re.compile(r"--[A-Za-z_]\w*(\.[A-Za-z_]\w*)+=")
"""A ``--section.key=value`` override (plait's own options have no dot before their ``=``)."""


def parse_command_line(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Parse ``argv`` (the arguments after ``plait``) into the verb's options and its ``--section.key=value``
    overrides. Exits with a usage error (code 2) on an unknown verb or option (named with the closest options), a
    missing required option, or a stray argument that is not an override."""
    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    argv = list(argv)
    verb = next((a for a in argv if not a.startswith("-")), None)
    if verb in verbs:
        _refuse_unknown_flags(verbs[verb], argv[argv.index(verb) + 1:])
    # Overrides are taken out before argparse: one holding a space (``--parallel.pp.stages={vision = 1}``) would
    # otherwise be read as the value of an option with an optional value, such as ``--resume``.
    overrides = [a for a in argv if _OVERRIDE.match(a)]
    args, rest = parser.parse_known_args([a for a in argv if not _OVERRIDE.match(a)])
    rest = overrides + rest
    bad = [a for a in rest if not (a.startswith("--") and "=" in a)]
    if bad:
        parser.error(f"unrecognised arguments {bad}; overrides look like --train.lr=1e-3")
    return args, rest


def check_job_arguments(args: argparse.Namespace, overrides: Sequence[str], *, run_folder: bool = True) -> None:
    """Check a parsed command's job file and overrides without loading torch (about 0.2 s): a verb outside
    ``_JOB_VERBS`` takes no overrides; a job verb's ``--config`` is read and validated with them as the verb will
    read it. With ``run_folder``, ``plait train`` and ``plait launch``'s launcher also refuse a run folder another
    live run holds.

    Raises:
        ValueError, FileNotFoundError: naming the override, the config key or the file.
    """
    if overrides and args.command not in _JOB_VERBS:
        raise ValueError(f"plait {args.command} takes no overrides, got {list(overrides)}")
    if args.command in _JOB_VERBS:  # a bad job file is refused in ~0.3 s, before torch and transformers load
        from plait.train.job_file import check_job

        check_job(args.config, overrides, planning=_JOB_VERBS[args.command],
                  run_folder=run_folder and (args.command == "train"
                                             or (args.command == "launch" and args.worker is None
                                                 and args.node_rank == 0)))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plait`` command; returns the exit code."""
    args, rest = parse_command_line(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        check_job_arguments(args, rest)
        if args.command != "simulate":  # the one verb that never loads a model (transformers: ~0.6 CPU-s)
            _quiet_transformers()
        commands = {"train": _train, "plan": _plan, "simulate": _simulate, "profile": _profile,
                    "generate": _generate, "tune-ranks": _tune_ranks, "energy": _energy,
                    "launch": _launch, "import": _import, "export": _export}
        return commands[args.command](args, rest)
    except (ValueError, FileNotFoundError) as exc:
        _report_error(exc)
        return 2
    except KeyboardInterrupt:
        print("plait: interrupted", file=sys.stderr)
        return 130


class _ExactParser(argparse.ArgumentParser):
    """A verb's parser that matches options by their full name only: argparse's prefix matching ran ``--o`` as
    ``--overwrite`` (removing an earlier run) and ``--resum`` as ``--resume``."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def _refuse_unknown_flags(verb: argparse.ArgumentParser, args: list[str]) -> None:
    """Exit with a usage error (code 2) naming the first argument of ``args`` that is neither one of ``verb``'s
    options, written in full, nor a ``--section.key=value`` override, with the closest options as suggestions.
    Checked before parsing, so ``--confg x`` is named itself (not reported as a missing ``--config``)."""
    known = sorted(o for o in verb._option_string_actions if o.startswith("--"))
    takes_value = {o for o, action in verb._option_string_actions.items() if action.nargs != 0}
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if not arg.startswith("-") or arg == "--":
            continue
        name = arg.split("=", 1)[0]
        if name in verb._option_string_actions:
            skip = "=" not in arg and name in takes_value and verb._option_string_actions[name].nargs != "?"
            continue
        if arg.startswith("--") and "=" in arg and "." in name:
            continue  # an override, checked against the job's fields by the job file check
        close = [o for o in known if o.startswith(name)]
        close += [o for o in difflib.get_close_matches(name, known, n=2, cutoff=0.6) if o not in close]
        close = close[:2]
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        if "." in name and "=" not in arg:
            hint = f"; an override needs a value: {name}=VALUE"
        verb.error(f"unrecognised argument {arg!r} (options are matched by their full name{hint}); overrides look "
                   f"like --train.lr=1e-3")


def _quiet_transformers() -> None:
    """transformers' own logging to errors only and no progress bars ("Writing model shards" per checkpoint or final
    save). Importing transformers takes seconds, so this runs after the job file is checked."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _report_error(exc: Exception) -> None:
    """Print ``exc`` as one ``plait: error:`` line. Under torchrun an error every rank hits alike (a bad config)
    is printed by rank 0 only; any other error names the rank that raised it."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and getattr(exc, "same_on_every_rank", False):
        if rank == 0:
            _error_line(f"plait: error: {exc}")
        return
    where = f" (rank {rank} of {world})" if world > 1 else ""
    _error_line(f"plait: error{where}: {exc}")


def _error_line(line: str) -> None:
    """Write ``line`` and its newline to stderr in one write: under torchrun the ranks share one stderr, unbuffered
    when ``PYTHONUNBUFFERED`` is set, where ``print``'s two writes (text, then newline) let another rank's line land
    between them (``... --nproc_per_node 3plait: error (rank 1 of 2): ...``)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
