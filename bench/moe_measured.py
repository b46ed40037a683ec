"""Measured per-rank memory and step time of expert parallelism (EP) vs FSDP2-only on a tiny MoE MLLM (gloo, CPU,
fp32): the measured half of the MoE benchmark (``measure_moe`` is what a MoE table calls).

The model: the demo's vision encoder (frozen) and MLP projector (trained) in front of a Qwen3-MoE LLM (hidden 64,
2 layers, 8 experts of width 64, top-2), trained on the demo's image and text samples. Each column runs the same
job under torchrun on 2 processes, one microbatch of ``--microbatch`` samples per rank:

- ``FSDP2``: ``parallel.dp_shard = 2``: every parameter, experts included, sharded and all-gathered per layer;
- ``EP``: ``parallel.ep = 2`` over ``dp = 2``: each rank holds 4 of the 8 experts, tokens sent to them by
  all-to-all; the other parameters replicated (their gradients all-reduced);
- ``EP x FSDP2``: ``parallel.ep = 2`` with ``dp_shard = 2``: experts split by EP, the rest sharded by FSDP2.

Each rank counts, once per distinct storage (``bench/tensor_bytes.py``; a DTensor by its local shard), its
parameters (and of them the experts'), the gradients at the end of a step's backward (before the optimizer step)
and AdamW state, and the wall time of each later step; the table gives the
largest over the ranks and the median step time (measured, never asserted: 2 shared CPU cores, so the times say
what the collectives cost here, not on GPUs).

Run: ``.venv/bin/python bench/moe_measured.py [--steps 4] [--microbatch 2]`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.tensor_bytes import storage_bytes  # noqa: E402

__all__ = ["COLUMNS", "MOE_LLM", "measure_moe", "measured_rows", "predicted", "print_table", "table_lines"]

MOE_LLM = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
               num_experts_per_tok=2, max_position_embeddings=512)
COLUMNS = {"FSDP2": {"dp_shard": 2, "dp": 1}, "EP": {"ep": 2, "dp": 2}, "EP x FSDP2": {"ep": 2, "dp_shard": 2,
                                                                                      "dp": 1}}
KINDS = ("parameters", "gradients", "optimizer")
LIMIT_S = 300


def job_dict(parallel: dict, microbatch: int, steps: int, train_file: str, run_dir: str) -> dict:
    """The demo job with the MoE LLM, no audio branch, the vision encoder frozen, ``parallel`` in ``[parallel]``."""
    from plait.config.loader import read_config_data

    data = read_config_data(ROOT / "configs" / "demo.toml")
    data["model"]["llm"]["config"] = dict(MOE_LLM)
    del data["model"]["encoders"]["audio"]
    data["model"]["encoders"]["vision"]["freeze"] = True
    data["data"].update(train=train_file, val=None, shuffle=False)
    data["train"].update(global_batch_size=2 * microbatch, microbatch_size=microbatch, steps=steps,
                         microbatch_policy="arrival", eval_every=0)
    data["parallel"] = {"timeout_s": 120, **parallel}
    data["metrics"].update(run_dir=run_dir, progress=False, tensorboard=False)
    data["checkpoint"] = {"every": 0}
    return data


def worker(spec_path: str, out_dir: str) -> None:
    """One rank of one column (under torchrun): build, one step, then timed steps; writes ``rank<r>.json``."""
    from plait.config.loader import config_from_dict
    from plait.parallel.expert_parallel import experts_modules
    from plait.train.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    trainer = Trainer.build(config_from_dict(spec["job"]))
    order = trainer.loader.epoch_order(0).tolist()
    batch = order[: trainer.cfg.train.global_batch_size]
    trainer.train_step(batch)  # AdamW's state exists from here
    trainer.forward_backward(batch, trainer.plan_step(batch)[0])  # the gradients a step holds at its end
    params = list(trainer.model.parameters())
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    experts = [p for m in (m for _, m in experts_modules(trainer.model)) for p in (m.gate_up_proj, m.down_proj)]
    out = {"parameters": storage_bytes(params), "experts": storage_bytes(experts),
           "gradients": storage_bytes(p.grad for p in params if p.grad is not None),
           "optimizer": storage_bytes(state), "times": []}
    trainer.optimizer.zero_grad(set_to_none=True)
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        trainer.train_step(batch)
        out["times"].append(time.perf_counter() - start)
    Path(out_dir, f"rank{trainer.info.rank}.json").write_text(json.dumps(out))
    if trainer.info.world_size > 1:
        torch.distributed.destroy_process_group()


def _train_file(folder: Path) -> str:
    """The demo's image and text samples (absolute media paths) as a JSONL file in ``folder``."""
    demo = ROOT / "data" / "demo"
    lines = []
    for line in (demo / "train.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["task"] in ("image_digit", "text"):
            rec["images"] = [str(demo / p) for p in rec["images"]]
            lines.append(json.dumps(rec))
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines[:64]) + "\n")
    return str(path)


def _run_column(label: str, microbatch: int, steps: int, folder: Path, train_file: str) -> dict | str:
    """Per-rank maxima and the median step time of one column on 2 processes, or why it did not run."""
    out = folder / label.replace(" ", "")
    out.mkdir(parents=True, exist_ok=True)
    spec = {"job": job_dict(COLUMNS[label], microbatch, steps + 1, train_file, str(out / "run")), "steps": steps}
    (out / "spec.json").write_text(json.dumps(spec))
    port = 29500 + (os.getpid() * 7 + len(os.listdir(folder))) % 20000
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           "--master_addr=127.0.0.1", str(Path(__file__).resolve()), "--worker", str(out / "spec.json"), str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"timed out after {LIMIT_S} s"
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) != 2:
        lines = [line for line in (stderr or stdout).splitlines() if "Error" in line]
        return (lines[-1] if lines else f"exit {proc.returncode}")[:160]
    result = {kind: max(r[kind] for r in ranks) for kind in (*KINDS, "experts")}
    result["step_s"] = statistics.median(max(ts) for ts in zip(*(r["times"] for r in ranks)))
    return result


def measure_moe(columns: tuple[str, ...] = tuple(COLUMNS), microbatch: int = 2, steps: int = 4
                ) -> dict[str, dict | str]:
    """Per column of :data:`COLUMNS`: the largest per-rank bytes of parameters, gradients and AdamW state
    (``int``; ``experts``: the expert parameters' share of ``parameters``) and the median step time in seconds (``step_s``: per step the slower rank's), or a string saying
    why the column did not run. Runs each column under torchrun on 2 processes (gloo, CPU)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        train_file = _train_file(folder)
        return {label: _run_column(label, microbatch, steps, folder, train_file) for label in columns}


def predicted(label: str) -> dict[str, float]:
    """The planner's bytes per rank of ``label``'s column (:data:`COLUMNS`): ``parameters``, ``gradients``,
    ``optimizer`` (``planner.cost.sharding.rank_memory`` on the job's units, ``models.plan_inputs.build_plan_inputs``
    on the CPU preset, fp32, AdamW's two moments) and ``experts`` (the routed experts' share of the parameters). The
    planner charges the pipeline units' modules only (the frozen SigLIP tower's unused post-norm and pooling head are
    not predicted)."""
    from plait.config.loader import config_from_dict
    from plait.models.plan_inputs import build_plan_inputs
    from plait.planner.cost.sharding import rank_memory, shard_costs
    from plait.planner.cost.types import OptimizerSpec, ParallelDegrees
    from plait.planner.pipeline.graph import consistent_units

    column = COLUMNS[label]
    inputs = build_plan_inputs(config_from_dict(job_dict(column, 2, 1, "train.jsonl", "run")), "cpu")
    units = consistent_units(inputs.units)
    degrees = ParallelDegrees(dp_shard=column.get("dp_shard", 1), ep=column.get("ep", 1))
    memory = rank_memory(units, inputs.costs, degrees, dtype="fp32",
                         optimizer=OptimizerSpec(grad_bytes_per_param=4, state_bytes_per_param=8))
    experts = sum(c.expert_param_bytes for c in shard_costs(units, inputs.costs, degrees))
    return {"parameters": memory.parameters, "gradients": memory.gradients, "optimizer": memory.optimizer,
            "experts": float(experts)}


def table_lines(results: dict[str, dict | str]) -> list[str]:
    """The table of :func:`measure_moe`'s results: KiB per rank (measured; ``planned``: the planner's total,
    :func:`predicted`) and milliseconds per step."""
    lines = [f"{'column':<12} {'params KiB':>11} {'of experts':>10} {'grads KiB':>10} {'AdamW KiB':>10} "
             f"{'total KiB':>10} {'planned KiB':>11} {'step ms':>8}"]
    for label, r in results.items():
        if isinstance(r, str):
            lines.append(f"{label:<12} did not run: {r}")
            continue
        total = sum(r[k] for k in KINDS)
        planned = sum(predicted(label)[k] for k in KINDS)
        lines.append(f"{label:<12} {r['parameters'] / 1024:>11.1f} {r['experts'] / 1024:>10.1f} "
                     f"{r['gradients'] / 1024:>10.1f} {r['optimizer'] / 1024:>10.1f} {total / 1024:>10.1f} "
                     f"{planned / 1024:>11.1f} {1000 * r['step_s']:>8.1f}")
    return lines


def print_table(results: dict[str, dict | str]) -> None:
    """Print :func:`table_lines`."""
    print("\n".join(table_lines(results)))


def measured_rows(microbatch: int = 2, steps: int = 4) -> list[str]:
    """:func:`measure_moe` on every column as printable lines (:func:`table_lines`; ``bench/moe.py`` prints them)."""
    return table_lines(measure_moe(microbatch=microbatch, steps=steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per column, after one untimed step")
    parser.add_argument("--microbatch", type=int, default=2, help="samples per rank per step")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    print_table(measure_moe(microbatch=args.microbatch, steps=args.steps))


if __name__ == "__main__":
    main()
