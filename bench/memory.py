"""Per-rank memory of DDP vs FSDP2 vs TP vs TP x FSDP2, with and without activation checkpointing, measured from real
tensor storages, next to the planner's prediction.

For each model (the demo ``configs/demo.toml``; ``larger``: the demo job with an 8-layer 512-wide LLM and a 6-layer
256-wide vision encoder, ``bench/activation_checkpointing.py``'s overrides) and each column (``parallel.dp_shard``,
``parallel.tp``, ``train.activation_checkpointing``), the job is trained under torchrun (gloo, CPU, fp32) on
``dp x dp_shard`` microbatches of ``--microbatch`` samples: one microbatch per batch rank, so every column's ranks
see microbatches of the same size. Each rank then counts, once per distinct storage (``untyped_storage()``, so
tied and shared tensors count once; a sharded or TP-split parameter by its local shard):

- parameters: the model's parameters (local shards of DTensors);
- gradients: their ``.grad`` after one forward/backward;
- optimizer state: every tensor in AdamW's state (``exp_avg``, ``exp_avg_sq``, ``step``);
- saved activations: what autograd keeps for the backward of one forward/backward
  (``torch.autograd.graph.saved_tensors_hooks``) plus the tensor arguments a checkpointed layer holds for its
  recomputation, excluding parameters (a matmul saves its weight: that is parameter memory, counted above); the
  one counter, ``bench/tensor_bytes.py``.

Under FSDP2 each rank also runs the batch again in 2 microbatches per rank and records, at each microbatch's start
(``ShardedModel.set_gradient_sync``) and after the last, per module the bytes of FSDP2's unsharded gradients (real
storages of each sharded parameter's accumulated unsharded gradient), summed over the modules: with
``parallel.fsdp_reduce = "step"`` every trainable unit's whole gradient (``accumulated_gradients``, next to the
planner's ``sharding.unsharded_grad_bytes``), with ``"microbatch"`` none between microbatches
(``reduced_gradients``). It also runs the batch once with every group keeping its gathered parameters from forward
to backward (``parallel.fsdp_reshard = "after_backward"``, set at runtime) and records the most bytes of gathered
parameters FSDP2 holds after any group's forward (``kept_parameters``, next to the planner's
``sharding.kept_param_bytes``; the other kinds do not change with the mode: only this transient buffer does).

The table gives each per-rank figure (the largest over the ranks), its ratio to DDP's (the same per-rank bytes as
one process: every DDP rank holds everything), and the planner's prediction (``planner.sharding.rank_memory``:
the job's pipeline units, analytic costs of the rank's microbatch, fp32 with AdamW's 8 state bytes per trained
parameter). Target: the trainable state per rank within 10% of 1/N of DDP's for N-way sharding.

Run: ``.venv/bin/python bench/memory.py [--models demo,larger] [--columns ...]`` (a few minutes on 2 CPU cores;
columns that cannot run yet print why).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.activation_checkpointing import MODELS  # noqa: E402
from bench.plan_holds import small_train_set  # noqa: E402
from bench.tensor_bytes import saved_activation_bytes, storage_bytes  # noqa: E402
from plait.planner.cost.types import OptimizerSpec  # noqa: E402

COLUMNS = {  # label -> (dp_shard, tp)
    "DDP": (1, 1),
    "FSDP2 2": (2, 1),
    "FSDP2 4": (4, 1),
    "TP 2": (1, 2),
    "TP 2 x FSDP2 2": (2, 2),
}
KINDS = ("parameters", "gradients", "optimizer", "activations")
EXTRA = {"accumulated_gradients": False, "reduced_gradients": True}
KEPT = "kept_parameters"
"""FSDP2's gathered parameters at the end of a forward with ``fsdp_reshard = "after_backward"``
(``kept_parameter_bytes``)."""
"""FSDP2's peak unsharded gradients over 2 microbatches per rank (``peak_unsharded_gradients``): key -> reduced
every microbatch."""
LIMIT_S = 240
_OPTIMIZER = OptimizerSpec(grad_bytes_per_param=4, state_bytes_per_param=8)
"""fp32 gradients and AdamW's two fp32 moments, per trained parameter (bytes)."""


def job_config(model: str, dp_shard: int, tp: int, policy: str, microbatch: int, train_file: str, run_dir: str):
    """The demo job (``model``'s overrides) for one column: ``dp_shard x tp`` processes, one microbatch of
    ``microbatch`` samples per batch rank."""
    from plait.config.loader import load_config

    overrides = [*MODELS[model], f"--train.activation_checkpointing={policy}",
                 f"--train.global_batch_size={microbatch * dp_shard}", f"--train.microbatch_size={microbatch}",
                 "--train.steps=10", f"--parallel.dp_shard={dp_shard}", f"--parallel.tp={tp}", "--parallel.dp=1",
                 f"--metrics.run_dir={run_dir}"]
    cfg = load_config(ROOT / "configs" / "demo.toml", overrides)
    cfg.data.val = None
    cfg.data.train = train_file
    return cfg


def measure(trainer, indices) -> dict[str, int]:
    """This rank's bytes of each kind (module docstring) after one optimizer step and one more forward/backward."""
    trainer.train_step(indices)  # AdamW's state exists from here
    trainer.optimizer.zero_grad(set_to_none=True)
    plan, _ = trainer.plan_step(indices)
    activations = saved_activation_bytes(trainer.model, lambda: trainer.forward_backward(indices, plan))
    params = [p for p in trainer.model.parameters()]
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in params if p.grad is not None]
    return {"parameters": storage_bytes(params), "gradients": storage_bytes(grads), "optimizer": storage_bytes(state),
            "activations": activations, "rank_llm_tokens": _rank_tokens(trainer, indices, plan)}


def unsharded_gradient_bytes(sharded, module: str) -> int:
    """Bytes of the unsharded gradients FSDP2 holds now for ``module``'s groups (real storages, each once): every
    sharded parameter's accumulated unsharded gradient (``FSDPParam.unsharded_accumulated_grad``, else its unsharded
    parameter's ``.grad``)."""
    grads = []
    for group in sharded.groups.get(module, []):
        for param_group in group._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in param_group.fsdp_params:
                whole = getattr(fsdp_param, "_unsharded_param", None)
                grads += [t for t in (fsdp_param.unsharded_accumulated_grad, getattr(whole, "grad", None))
                          if t is not None]
    return storage_bytes(grads)


def peak_unsharded_gradients(trainer, indices, each_microbatch: bool, microbatches: int = 2) -> int:
    """Per module (the LLM, each encoder) the most bytes of its unsharded gradients (:func:`unsharded_gradient_bytes`)
    at each microbatch's gradient-sync switch (``ShardedModel.set_gradient_sync``: before each backward, so after
    the earlier microbatches' backwards) and after the last, summed over the modules, over one forward/backward of
    ``indices`` in ``microbatches`` microbatches per rank, gradients reduce-scattered every microbatch
    (``each_microbatch``, ``parallel.fsdp_reduce = "microbatch"``) or once. With ``"step"`` this is each module's
    whole accumulated gradient: what the planner charges (``sharding.unsharded_grad_bytes``; all modules at once when
    the encoders' backwards are not deferred past the LLM's last). 0 without FSDP2. The trainer's microbatch size
    and reduction are restored, its gradients cleared."""
    sharded, train = trainer.sharded, trainer.cfg.train
    if sharded is None:
        return 0
    size, each, peaks = train.microbatch_size, sharded.reduce_each_microbatch, dict.fromkeys(sharded.groups, 0)
    original = sharded.set_gradient_sync

    def record() -> None:
        for module in peaks:
            peaks[module] = max(peaks[module], unsharded_gradient_bytes(sharded, module))

    def recording(sync: bool, module: str | None = None) -> None:
        record()
        original(sync, module)

    sharded.set_gradient_sync, sharded.reduce_each_microbatch = recording, each_microbatch
    train.microbatch_size = max(1, size // microbatches)
    try:
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.forward_backward(indices, trainer.plan_step(indices)[0])
        record()
    finally:
        train.microbatch_size, sharded.reduce_each_microbatch = size, each
        del sharded.set_gradient_sync  # the method again
        trainer.optimizer.zero_grad(set_to_none=True)
    return sum(peaks.values())


def gathered_parameter_bytes(sharded) -> int:
    """Bytes of the parameters FSDP2 holds gathered now (real storages of every unsharded group's parameters)."""
    tensors = []
    for group in sharded.all_groups():
        for param_group in group._get_fsdp_state()._fsdp_param_groups:
            if param_group.is_unsharded:
                tensors += [p._unsharded_param for p in param_group.fsdp_params if hasattr(p, "_unsharded_param")]
    return storage_bytes(tensors)


def kept_parameter_bytes(trainer, indices) -> int:
    """The most bytes of gathered parameters (:func:`gathered_parameter_bytes`) after any FSDP2 group's forward over
    one forward/backward of ``indices`` with every group keeping its parameters from forward to backward
    (``set_reshard_after_forward(False)``: ``parallel.fsdp_reshard = "after_backward"``): what the planner charges
    (``sharding.kept_param_bytes``). 0 without FSDP2. The groups' mode is restored, the gradients cleared."""
    sharded = trainer.sharded
    if sharded is None:
        return 0
    groups, peak = sharded.all_groups(), [0]

    def after_forward(*_) -> None:  # registered after FSDP2's own post-forward hook: runs after it
        peak[0] = max(peak[0], gathered_parameter_bytes(sharded))

    modules = {id(m): m for g in groups for m in g._get_fsdp_state()._modules}
    handles = [m.register_forward_hook(after_forward) for m in modules.values()]
    for g in groups:
        g.set_reshard_after_forward(False, recurse=False)
    try:
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.forward_backward(indices, trainer.plan_step(indices)[0])
    finally:
        for h in handles:
            h.remove()
        for g in groups:
            g.set_reshard_after_forward(sharded.reshard_after_forward, recurse=False)
        trainer.optimizer.zero_grad(set_to_none=True)
    return peak[0]


def _rank_tokens(trainer, indices, plan) -> dict:
    """This rank's microbatch as the planner sees it: samples, their padded LLM length and items per encoder."""
    rank = trainer.dims.batch_rank(trainer.info.rank)
    positions = [k for mb in plan.microbatches[rank] for k in mb]
    metas = [trainer.train_set.sample_meta(indices[k]) for k in positions]
    items: dict[str, int] = {}
    for meta in metas:
        for name, _ in meta.items:
            items[name] = items.get(name, 0) + 1
    return {"samples": len(metas), "max_tokens": max((m.length for m in metas), default=1), "items": items}


def covering_batch(trainer, size: int) -> list[int]:
    """``size`` training samples in epoch order, those with items of each encoder first, so that every encoder (and
    so every trainable unit) runs and holds its gradients: the memory the planner predicts is this worst case."""
    order = trainer.loader.epoch_order(0).tolist()
    chosen: list[int] = []
    for name in trainer.model.encoders:
        found = next((i for i in order if i not in chosen and any(e == name for e, _ in
                                                                   trainer.train_set.sample_meta(i).items)), None)
        if found is not None and len(chosen) < size:
            chosen.append(found)
    return chosen + [i for i in order if i not in chosen][: size - len(chosen)]


def worker(spec_path: str, out_dir: str) -> None:
    """One rank of one column (under torchrun): build, measure, write ``rank<r>.json``."""
    from plait.train.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    torch.manual_seed(0)
    cfg = job_config(spec["model"], spec["dp_shard"], spec["tp"], spec["policy"], spec["microbatch"],
                     spec["train"], spec["run_dir"])
    trainer = Trainer.build(cfg)
    indices = covering_batch(trainer, cfg.train.global_batch_size)
    out = measure(trainer, indices)
    out.update({key: peak_unsharded_gradients(trainer, indices, each) for key, each in EXTRA.items()})
    out[KEPT] = kept_parameter_bytes(trainer, indices)
    out["rank"] = trainer.info.rank
    Path(out_dir, f"rank{trainer.info.rank}.json").write_text(json.dumps(out))
    if trainer.info.world_size > 1:
        torch.distributed.destroy_process_group()


def run_column(model: str, label: str, policy: str, microbatch: int, folder: Path, train: Path) -> dict | str:
    """Per-rank maxima of one column (torchrun, ``dp_shard x tp`` processes), or why it did not run."""
    dp_shard, tp = COLUMNS[label]
    out = folder / f"{model}_{label.replace(' ', '')}_{policy}"
    out.mkdir(parents=True, exist_ok=True)
    spec = dict(model=model, dp_shard=dp_shard, tp=tp, policy=policy, microbatch=microbatch, train=str(train),
                run_dir=str(out / "run"))
    (out / "spec.json").write_text(json.dumps(spec))
    port = 29500 + (os.getpid() * 7 + len(os.listdir(folder))) % 20000
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={dp_shard * tp}", f"--master_port={port}",
           "--master_addr=127.0.0.1", str(Path(__file__).resolve()), "--worker", str(out / "spec.json"), str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)  # its own process group: a hung column is killed whole
    try:
        proc.stdout_text, proc.stderr_text = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"timed out after {LIMIT_S} s (a hung collective?)"
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) != dp_shard * tp:
        lines = [line for line in (proc.stderr_text or proc.stdout_text).splitlines() if "Error" in line]
        return (lines[-1] if lines else f"exit {proc.returncode}")[:160]
    result = {kind: max(r[kind] for r in ranks) for kind in (*KINDS, *EXTRA, KEPT)}
    result["rank_llm_tokens"] = [r["rank_llm_tokens"] for r in ranks]
    return result


def predicted(trainer, label: str, tokens: dict | list[dict]) -> dict[str, float]:
    """The planner's per-rank bytes of a column (``planner.sharding.rank_memory``; module docstring): the units of
    ``trainer`` (a one-process trainer of the job), analytic costs of a rank's microbatch (``tokens``: LLM samples x
    padded length; each encoder its items at their native length); for a list (one per rank) the largest over the
    ranks of each kind, as measured."""
    if isinstance(tokens, list):
        each = [predicted(trainer, label, t) for t in tokens]
        return {kind: max(e[kind] for e in each) for kind in each[0]}
    from plait.parallel.activation_checkpointing import checkpoint_policy
    from plait.planner.cost.sharding import rank_memory
    from plait.planner.cost.types import ParallelDegrees

    dp_shard, tp = COLUMNS[label]
    units, costs = _unit_costs(trainer, tokens)
    default, overrides = checkpoint_policy(trainer.cfg)
    memory = rank_memory(units, costs, ParallelDegrees(tp, dp_shard, default), dtype="fp32", optimizer=_OPTIMIZER,
                         checkpoint_overrides=overrides)
    return {"parameters": memory.parameters, "gradients": memory.gradients, "optimizer": memory.optimizer,
            "activations": memory.activations}


def predicted_unsharded_gradients(trainer, label: str, tokens: dict) -> float:
    """The planner's bytes of every trainable unit's unsharded gradient on one TP rank of a column
    (``planner.sharding.unsharded_grad_bytes``): what ``fsdp_reduce = "step"`` keeps between microbatches."""
    from plait.planner.cost.sharding import unsharded_grad_bytes
    from plait.planner.cost.types import ParallelDegrees

    dp_shard, tp = COLUMNS[label]
    units, costs = _unit_costs(trainer, tokens)
    return unsharded_grad_bytes(units, costs, ParallelDegrees(tp, dp_shard), "fp32", _OPTIMIZER)


def predicted_kept_parameters(trainer, label: str, tokens: dict) -> float:
    """The planner's bytes of gathered parameters kept from forward to backward on one rank of a column under
    ``parallel.fsdp_reshard = "after_backward"`` (``planner.sharding.kept_param_bytes``; 0 without FSDP2)."""
    from plait.planner.cost.sharding import kept_param_bytes
    from plait.planner.cost.types import ParallelDegrees

    dp_shard, tp = COLUMNS[label]
    units, costs = _unit_costs(trainer, tokens)
    return kept_param_bytes(units, costs, ParallelDegrees(tp, dp_shard, fsdp_reshard="after_backward"), "fp32",
                            _OPTIMIZER)


def _unit_costs(trainer, tokens: dict) -> tuple[list, list]:
    """The job's pipeline units and their analytic fp32 costs of one rank's microbatch (``predicted``)."""
    from plait.models.plan_inputs import plan_configs
    from plait.models.units import model_units
    from plait.planner.cost.analytic import unit_costs
    from plait.planner.cost.types import DeviceSpec, MicrobatchShape

    units = model_units(trainer.model)
    configs = plan_configs({"llm": trainer.model.language_model.config,
                            **{n: b.encoder.config for n, b in trainer.model.encoders.items()}})
    shapes = {"llm": MicrobatchShape(tokens["samples"] * tokens["max_tokens"], tokens["max_tokens"])}
    for name in trainer.model.encoders:
        length = configs[name].item_len
        shapes[name] = MicrobatchShape(max(1, tokens["items"].get(name, 0)) * length, length)
    return units, unit_costs(units, configs, shapes, DeviceSpec.cpu(), "fp32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="demo,larger")
    parser.add_argument("--columns", default=",".join(COLUMNS), help=f"of {list(COLUMNS)}")
    parser.add_argument("--policies", default="none,full")
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--samples", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        train = small_train_set(ROOT / "data" / "demo" / "train.jsonl", args.samples, folder)
        for model in args.models.split(","):
            for policy in args.policies.split(","):
                print_table(model, policy, args.columns.split(","), args.microbatch, folder, train)


def print_table(model: str, policy: str, labels: list[str], microbatch: int, folder: Path, train: Path) -> None:
    """One table: a row per column (measured MiB per kind, trainable state ratio to DDP, planner / measured)."""
    print(f"\n{model}, activation checkpointing {policy}, {microbatch} samples per microbatch, per rank "
          "(largest over ranks), MiB measured [planner]")
    print(f"{'column':<16} " + " ".join(f"{k:>22}" for k in KINDS) + f" {'state x DDP':>11} {'total x DDP':>11} "
          f"{'planner/meas':>12} {'kept params (after_backward)':>28}")
    from plait.train.trainer import Trainer

    one = Trainer.build(job_config(model, 1, 1, policy, microbatch, str(train), str(folder / f"one_{model}_{policy}")))
    base = None
    for label in labels:
        got = run_column(model, label, policy, microbatch, folder, train)
        if isinstance(got, str):
            print(f"{label:<16} not runnable: {got}")
            continue
        pred = predicted(one, label, got["rank_llm_tokens"])
        kept = predicted_kept_parameters(one, label, got["rank_llm_tokens"][0])  # parameters only: any rank's
        state = sum(got[k] for k in KINDS[:3])
        total = state + got["activations"]
        if label == "DDP":
            base = (state, total)
        ratios = f" {state / base[0]:>11.3f} {total / base[1]:>11.3f}" if base else f" {'-':>11} {'-':>11}"
        print(f"{label:<16} " + " ".join(f"{got[k] / 2**20:>10.3f} [{pred[k] / 2**20:>9.3f}]" for k in KINDS)
              + ratios + f" {sum(pred.values()) / total:>12.3f} {got[KEPT] / 2**20:>16.3f} [{kept / 2**20:>9.3f}]")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
