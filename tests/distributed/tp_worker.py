"""Worker of the model-level tensor-parallel test: every rank builds the tiny composite twice from one seed, runs
the reference unsharded in-process and the other split over the TP mesh (plait attention with a multimodal
mask), and compares losses, full gradients and parameters after a few AdamW steps with clipping."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from plait.attention.interface import use_plait_attention
from plait.attention.masks import MaskInfo
from plait.config.loader import config_from_dict
from plait.data.chat_template import tokenizer_dir
from plait.data.collate import collate
from plait.data.loader import MultimodalDataset
from plait.models.registry import build_model, build_processor, load_tokenizer
from plait.parallel.tensor_parallel import apply_tensor_parallel, clip_grad_norm_
from plait.train.loss import token_loss_sum
from plait.train.optim import build_optimizer
from tests.distributed.spawning import gloo_group


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss(model, batch, info) -> torch.Tensor:
    logits = model(batch.input_ids, batch.modality_inputs, None, batch.position_ids, plait_mask=info)
    return token_loss_sum(logits, batch.labels) / int((batch.labels != -100).sum())


def _train(model, batch, info, steps: int, clip: float, tp: int) -> tuple[list[float], dict, list[float]]:
    optimizer = build_optimizer(model, 1e-3, 0.01, (0.9, 0.999))
    losses, norms, first = [], [], {}
    for step in range(steps):
        loss = _loss(model, batch, info)
        loss.backward()
        if step == 0:
            first = {n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
        params = [p for _, p in model.trainable_parameters()]
        if tp > 1:
            norms.append(clip_grad_norm_(params, clip, copies=tp))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, first, norms


def main(rank: int, world: int, port: int, cfg_dict: dict, result_path: str) -> None:
    with gloo_group(rank, world, port, timeout_s=60):
        cfg = config_from_dict(cfg_dict)
        tokenizer = load_tokenizer(tokenizer_dir(cfg.data, cfg.model), cfg.data.chat_template)
        ref = build_model(cfg.model, tokenizer, seed=3)
        model = build_model(cfg.model, tokenizer, seed=3)
        processor = build_processor(cfg.model, ref, tokenizer, cfg.data.max_length)
        data = MultimodalDataset(cfg.data.train, processor)
        batch = collate([data[i] for i in range(len(data))], processor.pad_id)
        info = MaskInfo.from_batch(vars(batch), mode="bidirectional_items")
        for m in (ref, model):
            use_plait_attention(m.language_model, "sdpa")
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        plan = apply_tensor_parallel(model, mesh)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == {n for n, p in ref.named_parameters() if p.requires_grad}
        sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
        ref_losses, ref_grads, ref_norms = _train(ref, batch, info, 3, 0.5, 1)
        losses, grads, norms = _train(model, batch, info, 3, 0.5, world)
        params = {n: _full(p.detach()) for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({"ref_losses": ref_losses, "losses": losses, "ref_norms": ref_norms, "norms": norms,
                        "ref_grads": ref_grads, "grads": grads, "plan": plan, "sharded": sharded,
                        "ref_params": {n: p.detach() for n, p in ref.named_parameters()}, "params": params,
                        "heads": [getattr(m, "num_heads", None) for n, m in model.named_modules()
                                  if n.endswith("encoder.layers.0.self_attn")]}, result_path)
        dist.barrier()
