"""Prepared GPU check of issue 14 (sharding, checkpointing, flex attention): one command, a few minutes on one GPU,
no manual steps, prints tables and exits 1 when a check fails.

1. **flex vs SDPA**: plait attention (``plait.attention.interface.plait_attention``) on a packed multimodal mask
   (rows of several documents, each with an image item whose tokens see each other: ``bidirectional_items``), with
   grouped-query heads: the flex backend (``torch.compile``'d ``flex_attention`` on CUDA) and plait's chunked SDPA
   backend, forward and backward, each against a float32 dense-mask SDPA reference; prints the largest error of the
   output and of the query/key/value gradients (relative to the reference's largest magnitude) and the milliseconds
   of one forward+backward. Passes when flex's error is at most 3 x SDPA's (or below 1e-2 in bf16, 1e-5 in fp32).
   On CPU flex has no backward: forward only, eager.
2. **training**: for each model (``demo``: ``configs/demo.toml``; ``1b``: the demo job with a 1.0B-parameter Llama
   LLM, a 86M SigLIP vision tower and a 19M Whisper audio encoder, about 1.1B parameters in all, from config
   overrides; ``tiny``: a few thousand parameters, for the CPU test) on the first ``--batch`` demo training samples
   (one microbatch), three runs of ``--steps`` timed optimizer steps after ``--warmup`` steps:

   - ``plait FSDP2 + AC``: plait attention (flex on CUDA, chunked SDPA on CPU), causal mask; the process joins a
     one-rank job (``torch.distributed`` with a local ``HashStore``: NCCL on CUDA, gloo on CPU) and every trainable
     pipeline unit is an FSDP2 group (``plait.parallel.fsdp.apply_fsdp`` on a 1-device mesh: bf16 parameters for
     compute, fp32 reduction and master weights on CUDA) under full activation checkpointing
     (``plait.parallel.activation_checkpointing``, non-reentrant); AdamW as plait builds it;
   - ``plait FSDP2``: the same without checkpointing;
   - ``HF loop``: the same model (same seed, same weights) with Hugging Face's own ``sdpa`` attention and the
     batch's padding mask, no FSDP2, no checkpointing, ``torch.optim.AdamW``: the plain loop a user writes.

   All three run in bf16 autocast on CUDA (fp32 on CPU). Printed per run: median step ms, tokens/s (real tokens of
   the batch), MFU (model FLOPs of one forward+backward, counted by ``torch.utils.flop_counter.FlopCounterMode`` on
   the HF run, recomputation not counted, over the step time and the device's dense bf16 peak:
   ``plait.measure.host_costs.host_device``'s preset on CUDA, the measured matmul peak on CPU), the peak device
   memory of the timed steps (``torch.cuda.max_memory_allocated``; n/a on CPU), the saved-activation MiB of one
   forward/backward (``bench/tensor_bytes.py``) and the first step's loss. Then plait's tokens/s over the HF loop's
   (ratio in one run) and the check that the first losses agree (same weights, same batch, same causal mask: within
   2% in bf16, 1e-4 in fp32).

3. **zero-bubble executor**: :func:`schedule_check`: the pipeline executor in one process under 1F1B, ZB-H1 and
   ZB-H2 (steps ms, actions per second, the losses and gradients agreeing).

Run on a GPU: ``.venv/bin/python bench/gpu_check.py`` (demo and 1b; expected 3-5 minutes, most of it building the
1b model three times on the CPU and compiling flex; not yet run on a GPU). On CPU, small:
``.venv/bin/python bench/gpu_check.py --device cpu --models tiny --steps 1`` (tests/e2e/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.tensor_bytes import saved_activation_bytes  # noqa: E402

ONE_B = [
    '--model.llm.config={ model_type = "llama", hidden_size = 2048, intermediate_size = 5632, num_hidden_layers = 22, '
    'num_attention_heads = 32, num_key_value_heads = 4, max_position_embeddings = 2048, tie_word_embeddings = false }',
    '--model.encoders.vision.config={ model_type = "siglip_vision_model", hidden_size = 768, intermediate_size = 3072, '
    'num_hidden_layers = 12, num_attention_heads = 12, image_size = 32, patch_size = 4, num_channels = 3 }',
    '--model.encoders.audio.config={ model_type = "whisper", d_model = 512, encoder_layers = 6, '
    'encoder_attention_heads = 8, encoder_ffn_dim = 2048, num_mel_bins = 80, max_source_positions = 150, '
    'decoder_layers = 1, decoder_attention_heads = 2, decoder_ffn_dim = 32, vocab_size = 64, bos_token_id = 1, '
    'eos_token_id = 2, pad_token_id = 0, decoder_start_token_id = 1 }',
]
TINY = [
    '--model.llm.config={ model_type = "llama", hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, '
    'num_attention_heads = 2, num_key_value_heads = 1, max_position_embeddings = 512, tie_word_embeddings = true }',
    '--model.encoders.vision.config={ model_type = "siglip_vision_model", hidden_size = 32, intermediate_size = 64, '
    'num_hidden_layers = 1, num_attention_heads = 2, image_size = 32, patch_size = 4, num_channels = 3 }',
    '--model.encoders.audio.config={ model_type = "whisper", d_model = 32, encoder_layers = 1, '
    'encoder_attention_heads = 2, encoder_ffn_dim = 64, num_mel_bins = 80, max_source_positions = 150, '
    'decoder_layers = 1, decoder_attention_heads = 2, decoder_ffn_dim = 32, vocab_size = 64, bos_token_id = 1, '
    'eos_token_id = 2, pad_token_id = 0, decoder_start_token_id = 1 }',
]
MODELS = {"demo": [], "1b": ONE_B, "tiny": TINY}
RUNS = ("plait FSDP2 + AC", "plait FSDP2", "HF loop")


# ------------------------------------------------------------------ 1. flex vs SDPA


def packed_mask(rows: int, tokens: int, doc_len: int, item_len: int, device: str):
    """A packed multimodal ``MaskInfo`` ``[rows, tokens]`` (``bidirectional_items``): documents of ``doc_len``
    tokens (the last one shorter), each with one item of ``item_len`` tokens after an 8-token prefix, and the last
    ``tokens // 16`` tokens of each row padding."""
    from plait.attention.masks import MaskInfo

    real = tokens - tokens // 16
    index = torch.arange(tokens)
    docs = torch.where(index < real, index // doc_len, -1)
    positions = torch.where(index < real, index % doc_len, 0)
    in_item = (positions >= 8) & (positions < 8 + item_len) & (index < real)
    items = torch.where(in_item, docs, -1)
    rows_of = lambda t: t.expand(rows, tokens).contiguous().to(device)  # noqa: E731
    return MaskInfo(rows_of(docs), rows_of(items), rows_of(positions), "bidirectional_items")


def _attention_pass(backend: str, q, k, v, info, grad_out, compile_flex: bool | None):
    """Output and (on tensors requiring grad) the q/k/v gradients of one plait attention forward+backward."""
    from plait.attention.interface import plait_attention

    q, k, v = (t.detach().requires_grad_(t.requires_grad) for t in (q, k, v))
    out = plait_attention(q, k, v, info, backend=backend, compile_flex=compile_flex)
    if not q.requires_grad:
        return out, ()
    out.backward(grad_out)
    return out, (q.grad, k.grad, v.grad)


def _reference(q, k, v, info, grad_out):
    """float32 dense-mask SDPA (``plait.attention.masks.dense_mask``): output and q/k/v gradients."""
    import torch.nn.functional as F

    from plait.attention.masks import dense_mask

    q, k, v = (t.detach().float().requires_grad_(t.requires_grad) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(info)[:, None], enable_gqa=True)
    if not q.requires_grad:
        return out, ()
    out.backward(grad_out.float())
    return out, (q.grad, k.grad, v.grad)


def _max_error(got, ref) -> float:
    """The largest ``max |got - ref| / max |ref|`` over the tensor pairs (relative to each reference's scale)."""
    return max(float((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30))
               for g, r in zip(got, ref))


def _timed_ms(fn, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def flex_check(device: str) -> bool:
    """Section 1 of the module docstring; returns whether flex is within the tolerance."""
    cuda = device == "cuda"
    rows, tokens, heads, kv_heads, dim = (2, 4096, 16, 4, 128) if cuda else (2, 256, 4, 2, 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    info = packed_mask(rows, tokens, doc_len=tokens // 3, item_len=tokens // 8, device=device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    make = lambda h: torch.randn(rows, h, tokens, dim, generator=gen).to(device, dtype)  # noqa: E731
    q, k, v, grad_out = make(heads), make(kv_heads), make(kv_heads), make(heads)
    for t in (q, k, v):
        t.requires_grad_(cuda)  # flex has no CPU backward: forward only there
    ref_out, ref_grads = _reference(q, k, v, info, grad_out)
    print(f"\n1. plait attention on a packed multimodal mask ({rows} rows x {tokens} tokens, 3 documents with an "
          f"image item each, {heads} query / {kv_heads} KV heads of {dim}, {str(dtype).removeprefix('torch.')}; "
          f"{'forward + backward, flex compiled' if cuda else 'forward only, flex eager: no CPU backward'}) vs a "
          "float32 dense-mask SDPA reference", flush=True)
    print(f"{'backend':<16} {'out rel err':>12} {'grad rel err':>13} {'fwd+bwd ms' if cuda else 'fwd ms':>11}")
    errors = {}
    for backend in ("flex", "sdpa"):
        run = lambda: _attention_pass(backend, q, k, v, info, grad_out, cuda)  # noqa: E731
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")  # CPU: eager, known
            out, grads = run()  # also the warm-up (flex compiles here on CUDA)
            ms = _timed_ms(run, device, 5 if cuda else 2)
        errors[backend] = (_max_error([out], [ref_out]), _max_error(grads, ref_grads) if grads else 0.0)
        grad = f"{errors[backend][1]:.2e}" if grads else "n/a"
        print(f"{backend:<16} {errors[backend][0]:>12.2e} {grad:>13} {ms:>11.2f}")
    floor = 1e-2 if cuda else 1e-5
    ok = all(errors["flex"][i] <= max(3 * errors["sdpa"][i], floor) for i in range(2))
    print(f"flex within max(3 x SDPA's error, {floor:g}) of the reference's scale: {ok}")
    return ok


# ------------------------------------------------------------------ 2. training


@dataclass
class RunResult:
    """One run of section 2: median step seconds, real tokens per step, peak device bytes (None on CPU),
    saved-activation bytes of one forward/backward, the first step's loss and the parameter count."""

    step_s: float
    tokens: int
    peak_bytes: int | None
    saved_bytes: int
    first_loss: float
    params: int


def job(model: str, device: str, run: str, batch: int):
    """The demo job with ``model``'s overrides for ``run`` (module docstring) on ``device``."""
    from plait.config.loader import load_config

    attention = "hf" if run == "HF loop" else ("plait" if device == "cuda" else "plait_sdpa")
    overrides = [*MODELS[model], f"--train.device={device}", "--data.num_workers=0", f"--train.microbatch_size={batch}",
                 f"--train.global_batch_size={batch}",
                 f"--train.threads={1 if device == 'cpu' else 0}",  # all cores build the model on a GPU host
                 f"--attention.implementation={attention}", "--attention.mask=causal",
                 f"--train.activation_checkpointing={'full' if run.endswith('AC') else 'none'}"]
    return load_config(ROOT / "configs" / "demo.toml", overrides)


def join_one_rank(device: str) -> None:
    """Join a one-rank job (local ``HashStore``; NCCL on CUDA, gloo on CPU) unless already joined."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)


def build_run(cfg, run: str, device: str):
    """``(inputs, optimizer)`` of one run: the model and batch (``build_profile_inputs``), then for plait runs
    activation checkpointing and FSDP2 on a one-device mesh (in that order, as the trainer)."""
    from torch.distributed.device_mesh import init_device_mesh

    from plait.measure.job_profile import build_profile_inputs
    from plait.models.units import unit_specs
    from plait.parallel.activation_checkpointing import apply_activation_checkpointing, checkpoint_policy
    from plait.parallel.fsdp import apply_fsdp
    from plait.train.optim import build_optimizer

    inputs = build_profile_inputs(cfg, microbatches=1, device=device)
    model, t = inputs.model, cfg.train
    if run == "HF loop":
        return inputs, torch.optim.AdamW([p for _, p in model.trainable_parameters()], lr=t.lr,
                                         weight_decay=t.weight_decay, betas=t.betas)
    apply_activation_checkpointing(model, *checkpoint_policy(cfg))
    join_one_rank(device)
    apply_fsdp(model, unit_specs(model), init_device_mesh(device, (1,), mesh_dim_names=("dp_shard",)), device)
    return inputs, build_optimizer(model, t.lr, t.weight_decay, t.betas)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def forward_backward(inputs, run: str) -> torch.Tensor:
    """Loss (mean over the batch's target tokens) of one forward/backward of the run's batch, after backward."""
    from plait.train.loss import token_loss_sum

    batch = inputs.microbatches[0]
    kwargs = inputs.llm_kwargs(batch)
    mask = None if "plait_mask" in kwargs else batch.attention_mask
    with inputs.autocast():
        logits = inputs.model(batch.input_ids, batch.modality_inputs, mask, batch.position_ids, **kwargs)
    loss = token_loss_sum(logits, batch.labels) / max(1, batch.target_tokens)
    loss.backward()
    return loss.detach()


def model_flops(inputs, run: str) -> float:
    """FLOPs of one forward+backward (``FlopCounterMode``; gradients cleared after)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        forward_backward(inputs, run)
    inputs.model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def time_run(inputs, optimizer, run: str, device: str, warmup: int, steps: int) -> RunResult:
    """``warmup`` + ``steps`` optimizer steps (median of the timed ones), then one counted forward/backward."""
    model = inputs.model
    model.train()
    losses, times = [], []
    for i in range(warmup + steps):
        if i == warmup and device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _sync(device)
        start = time.perf_counter()
        losses.append(forward_backward(inputs, run))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    saved = saved_activation_bytes(model, lambda: forward_backward(inputs, run))
    optimizer.zero_grad(set_to_none=True)
    tokens = int(inputs.microbatches[0].attention_mask.sum())
    params = sum(p.numel() for p in model.parameters())
    return RunResult(statistics.median(times[warmup:]), tokens, peak, saved, float(losses[0]), params)


def peak_flops(device: str, threads: int) -> tuple[float, str]:
    """The device's dense peak FLOP/s and its name (``measure.host_costs.host_device`` preset; measured on CPU)."""
    from plait.measure.host_costs import host_cpu, host_device
    from plait.planner.cost.types import DeviceSpec

    if device == "cuda":
        preset, _ = host_device()
        spec = getattr(DeviceSpec, preset)()
        return spec.peak_flops, f"{torch.cuda.get_device_name(0)} ({spec.name} preset, bf16 dense)"
    spec = host_cpu(max(1, threads), 1)
    return spec.peak_flops, spec.name


def run_model(model: str, args: argparse.Namespace, device: str) -> bool:
    """Section 2 for one model: the three runs, the table, the ratio and the loss check."""
    results: dict[str, RunResult] = {}
    flops = 0.0
    for run in reversed(RUNS):  # the HF loop first: its FLOPs are counted once, before anything is compiled
        print(f"  {model}: {run}: building and running {args.warmup} + {args.steps} steps ...", flush=True)
        cfg = job(model, device, run, args.batch)
        inputs, optimizer = build_run(cfg, run, device)
        if run == "HF loop":
            flops = model_flops(inputs, run)
            peak, peak_name = peak_flops(device, cfg.train.threads or torch.get_num_threads())
        results[run] = time_run(inputs, optimizer, run, device, args.warmup, args.steps)
        del inputs, optimizer
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    first = results["HF loop"]
    print(f"\n2. {model}: {first.params / 1e6:.1f} M parameters, {args.batch} samples ({first.tokens} tokens) per "
          f"step, {args.steps} timed steps after {args.warmup}, {flops / 1e9:.1f} GFLOP per forward+backward; "
          f"MFU against {peak / 1e12:.1f} TFLOP/s: {peak_name}")
    print(f"{'run':<18} {'step ms':>9} {'tokens/s':>10} {'MFU':>6} {'peak MiB':>9} {'saved MiB':>10} {'loss':>8}")
    for run in RUNS:
        r = results[run]
        mem = f"{r.peak_bytes / 2**20:.0f}" if r.peak_bytes is not None else "n/a"
        print(f"{run:<18} {r.step_s * 1e3:>9.1f} {r.tokens / r.step_s:>10.0f} {flops / r.step_s / peak:>6.1%} "
              f"{mem:>9} {r.saved_bytes / 2**20:>10.1f} {r.first_loss:>8.4f}")
    ratios = ", ".join(f"{run} {first.step_s / results[run].step_s:.2f}" for run in RUNS[:2])
    tol = 2e-2 if device == "cuda" else 1e-4
    diffs = [abs(results[run].first_loss - first.first_loss) / abs(first.first_loss) for run in RUNS[:2]]
    ok = max(diffs) <= tol
    print(f"tokens/s over the HF loop: {ratios}; first-step loss vs the HF loop within {tol:g}: {ok} "
          f"(largest relative difference {max(diffs):.1e})")
    return ok


def schedule_check(model: str, device: str, batch: int, repeats: int = 3) -> bool:
    """3. The pipeline executor under 1F1B and the zero-bubble ZB-H1 / ZB-H2 / ZB-V in one process (``model``'s job, every
    stage on this device: encoders and two LLM stages, 4 microbatches of ``batch`` samples each, everything
    trainable): median step ms and actions per second of each (the executor's overhead per action, with split
    backward's extra ``W`` actions), and the check that their losses and gradients agree (one backward's work,
    split or not: within 1e-5 relative in fp32, 2e-2 in bf16)."""
    from plait.measure.job_profile import build_profile_inputs
    from plait.models.units import model_units
    from plait.parallel.pipeline import run_pipeline_step
    from plait.parallel.stages import build_rank_stages
    from plait.planner.pipeline.plan import plan_pipeline
    from plait.planner.pipeline.schedules import build_schedule
    from plait.train.loss import token_loss_sum

    cfg = job(model, device, "plait FSDP2", batch)
    inputs = build_profile_inputs(cfg, microbatches=4, microbatch_size=batch, device=device)
    units = model_units(inputs.model)
    counts = {m: 1 for m in {u.module for u in units}} | {"llm": 2}
    plan = plan_pipeline(units, "encoder_parallel", stages_per_module=counts, ranks=[0] * (len(counts) + 1))
    stages = build_rank_stages(inputs.model, plan, 0)
    targets = sum(b.target_tokens for b in inputs.microbatches)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device == "cuda" else nullcontext
    print("\n3. pipeline executor, one process: 1F1B vs zero-bubble (split backward, W from the gradients B kept)")
    print(f"{'schedule':<8} {'actions':>7} {'step ms':>9} {'actions/s':>10} {'loss':>10} {'max grad err':>12}")
    ref_loss, ref_grads, ok = None, None, True
    for name in ("1f1b", "zb_h1", "zb_h2", "zb_v"):  # one rank: its two LLM stages are a V of one rank
        schedule = build_schedule(plan, name, len(inputs.microbatches))
        times = []
        for _ in range(repeats + 1):
            for p in stages.model.parameters():
                p.grad = None
            _sync(device)
            start = time.perf_counter()
            res = run_pipeline_step(stages, schedule, inputs.microbatches, targets, loss_fn=token_loss_sum,
                                    autocast=autocast)
            _sync(device)
            times.append(time.perf_counter() - start)
        grads = {n: p.grad.float().clone() for n, p in stages.trainable_parameters() if p.grad is not None}
        actions = len(schedule.actions[0])
        err = 0.0
        if ref_grads is None:
            ref_loss, ref_grads = res.loss, grads
        else:
            scale = max(float(g.abs().max()) for g in ref_grads.values())
            err = max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items()) / scale
            tol = 2e-2 if device == "cuda" else 1e-5
            ok = ok and sorted(grads) == sorted(ref_grads) and err <= tol and abs(res.loss - ref_loss) <= tol * abs(
                ref_loss)
        step = statistics.median(times[1:])
        print(f"{name:<8} {actions:>7} {1e3 * step:>9.1f} {actions / step:>10.0f} {res.loss:>10.5f} {err:>12.2e}")
    print(f"zero-bubble schedules equal 1F1B: {ok}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--models", default=None, help=f"of {list(MODELS)}; default demo,1b on CUDA, demo on CPU")
    parser.add_argument("--batch", type=int, default=None, help="samples per step (default 32 on CUDA, 4 on CPU)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2 on CUDA, 1 on CPU)")
    args = parser.parse_args()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    args.models = args.models or ("demo,1b" if cuda else "demo")
    args.batch = args.batch or (32 if cuda else 4)
    args.warmup = args.warmup if args.warmup is not None else (2 if cuda else 1)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown or args.steps < 1 or args.batch < 1 or args.warmup < 1:
        parser.error(f"unknown models {unknown} (of {list(MODELS)}) or --steps/--batch/--warmup below 1")
    started = time.perf_counter()
    print(f"plait GPU check (issue 14): {device}"
          + (f" ({torch.cuda.get_device_name(0)})" if cuda else "") + f", torch {torch.__version__}", flush=True)
    ok = flex_check(device)
    print("\n2. training: plait (FSDP2 world 1, with and without activation checkpointing) vs a plain HF loop",
          flush=True)
    for model in args.models.split(","):
        torch.compiler.reset()  # each model's shapes compile flex anew (static), not as dynamic shapes
        ok = run_model(model, args, device) and ok
    ok = schedule_check(args.models.split(",")[0], device, max(1, args.batch // 4)) and ok
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"\nall checks passed: {ok}; total {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
