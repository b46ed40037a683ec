"""FSDP2 groups of a model (plait.parallel.fsdp) in one process (a 1-rank gloo group): trainable units sharded, one
group per module, frozen units and tied embeddings replicated, LoRA adapters in groups of their own; and the
uniform step's padded encoder calls give the features and gradients of the plain encode."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from plait.config.loader import config_from_dict
from plait.data.chat_template import tokenizer_dir
from plait.models.registry import build_model, load_tokenizer
from plait.models.units import unit_specs
from plait.parallel.fsdp import apply_fsdp, gathered
from plait.train.step_run import dummy_llm_batch, encode_padded
from tests.helpers.jobs import tiny_config_dict
from tests.distributed.spawning import free_port


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def tiny_model(tmp_path, freeze_encoders: bool = False, lora: bool = False, tied: bool = False):
    cfg = config_from_dict(tiny_config_dict(str(tmp_path / "train.jsonl")))
    cfg.model.llm.config["tie_word_embeddings"] = tied
    for enc in cfg.model.encoders.values():
        enc.freeze = freeze_encoders
    if lora:
        cfg.model.llm.lora.r, cfg.model.llm.lora.alpha = 2, 4.0
    tokenizer = load_tokenizer(tokenizer_dir(cfg.data, cfg.model), cfg.data.chat_template)
    return build_model(cfg.model, tokenizer, seed=0)


def test_trainable_units_are_sharded_frozen_ones_replicated_and_a_tied_pair_is_one_group(tmp_path, one_rank):
    model = tiny_model(tmp_path, freeze_encoders=True, tied=True)
    sharded = apply_fsdp(model, unit_specs(model), one_rank, "cpu")
    assert sorted(sharded.groups) == ["audio", "llm", "vision"]
    assert [n for n in sharded.names if n.startswith("encoders.vision")] == ["encoders.vision.projector"]
    llm = [n for n in sharded.names if n.startswith("language_model.")]
    assert llm == ["language_model.model.embed_tokens (tied)", "language_model.model.layers.0",
                   "language_model.model.layers.1", "language_model.model.norm"]
    head = model.language_model.get_output_embeddings().weight
    assert head is model.language_model.get_input_embeddings().weight and isinstance(head, DTensor)
    assert sharded.replicated == []  # the tied embedding and head: one FSDP2 group, the weight sharded once
    assert not any(isinstance(p, DTensor) for p in model.encoders["vision"].encoder.parameters())  # frozen
    assert all(isinstance(p, DTensor) for p in model.encoders["vision"].projector.parameters())
    with gathered(sharded):
        assert not any(isinstance(p, DTensor) for p in model.language_model.model.layers[0].parameters())
    assert all(isinstance(p, DTensor) for p in model.language_model.model.layers[0].parameters())


def test_lora_adapters_get_groups_of_their_own(tmp_path, one_rank):
    model = tiny_model(tmp_path, lora=True)
    sharded = apply_fsdp(model, unit_specs(model), one_rank, "cpu")
    adapters = [n for n in sharded.names if n.endswith("(adapter)")]
    layer0 = [n for n in adapters if n.startswith("language_model.model.layers.0")]
    assert len(layer0) >= 2 and len(adapters) == 2 * len(layer0)  # lora_A and lora_B of each adapted projection
    for group, name in zip(sharded.all_groups(), sharded.names):
        if name.endswith("(adapter)"):  # one requires_grad per group: the adapters alone
            assert all(p.requires_grad and isinstance(p, DTensor) for p in group.parameters())
    base = model.language_model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert isinstance(base, DTensor) and not base.requires_grad  # the frozen base: sharded with its unit


def test_padded_encoder_calls_give_the_plain_features_and_gradients(tmp_path):
    model = tiny_model(tmp_path)
    branch = model.encoders["vision"]
    torch.manual_seed(0)
    inputs = {"pixel_values": [torch.randn(3, 32, 32), torch.randn(3, 16, 32)]}
    assert len(branch.item_groups(inputs)) == 2  # two image sizes: two encoder calls
    plain = model.encode("vision", inputs)
    plain.square().sum().backward()
    want = {n: p.grad.clone() for n, p in branch.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    padded = encode_padded(model, "vision", inputs, 4, torch.device("cpu"))  # 2 own calls + 2 on a dummy item
    torch.testing.assert_close(padded, plain, rtol=0, atol=0)
    padded.square().sum().backward()
    for name, grad in want.items():
        torch.testing.assert_close(dict(branch.named_parameters())[name].grad, grad, rtol=1e-6, atol=1e-7)
    dummy = encode_padded(model, "vision", None, 1, torch.device("cpu"))
    assert dummy.shape == (16, 32)  # one native 32x32 item: 16 patches, projected to the LLM width


def test_dummy_llm_batch_has_no_target():
    batch = dummy_llm_batch(pad_id=3, tokens=4, device=torch.device("cpu"))
    assert batch.input_ids.tolist() == [[3, 3, 3, 3]] and batch.target_tokens == 0
    assert batch.position_ids.tolist() == [[0, 1, 2, 3]] and batch.meta[0].length == 4
