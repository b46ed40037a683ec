"""Pixtral and InternVL vision branches: features equal the stock Hugging Face modules (Pixtral: ``PixtralVisionModel``
on the processor's padded batch of images of different sizes, packed with a block-diagonal mask; InternVL: the
input of ``InternVLModel``'s projector after its pixel shuffle, and ``get_image_features`` through that projector),
fp32 1e-5; feature counts shared with the processor; the cost model equals the real towers (parameters, FLOPs);
processor settings that cannot fit the tower refused when the job is built; the per-call hook (Pixtral's 2D RoPE and
block mask recomputed on a later stage) equals the stock forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T
from torch.utils.flop_counter import FlopCounterMode

from plait.config.loader import config_from_dict
from plait.data.processing import process_image
from plait.models.encoder import ModalityEncoder
from plait.models.families.internvl import InternVLFeatureCount, pixel_shuffle_features
from plait.models.families.pixtral import PixtralCall, PixtralFeatureCount, pixtral_inputs
from plait.models.hf import build_encoder, encoder_feature_size, encoder_layout, run_encoder_layer
from plait.models.projector import build_projector
from plait.models.plan_inputs import encoder_arch
from plait.planner.cost.arch import model_param_count, units_from_configs
from plait.planner.cost.analytic import unit_estimates
from plait.planner.cost.types import MicrobatchShape
from tests.helpers.jobs import TINY_LLM, tiny_config_dict, write_jsonl
from tests.helpers.pixtral_internvl import (TINY_INTERNVL, TINY_PIXTRAL, config_kwargs, internvl_model,
    random_images, stock_projector_input, tiling_processor, tiny_pixtral, vision_family_job)


def test_pixtral_features_equal_the_stock_tower_on_the_padded_batch():
    encoder = tiny_pixtral()
    processor = T.PixtralImageProcessorPil(patch_size=4, size={"longest_edge": 32})
    images = random_images([(24, 40), (16, 16), (50, 20)])
    padded = processor(images=images, return_tensors="pt")
    branch = ModalityEncoder(encoder, build_projector("linear", 32, 32), "image")
    items = [process_image(processor, img) for img in images]
    sizes = [size for _, size in items]
    assert sizes == [tuple(s) for s in padded["image_sizes"].tolist()] == [(20, 32), (16, 16), (32, 12)]
    inputs = {"pixel_values": [it["pixel_values"] for it, _ in items]}
    with torch.no_grad():
        stock = encoder(**padded).last_hidden_state[0]
        mine = branch.encoder_forward(inputs)
    assert [branch.feature_count(s) for s in sizes] == [40, 16, 24] and mine.shape == (80, 32)
    torch.testing.assert_close(mine, stock, rtol=1e-5, atol=1e-5)
    assert len(branch.item_groups(inputs)) == 1 and encoder_layout(encoder).post_norm is None


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_pixtral_call_recomputes_rope_and_block_mask_for_later_layers(attn):
    encoder = tiny_pixtral(attn, layers=3)
    kwargs = pixtral_inputs([torch.randn(3, 20, 32), torch.randn(3, 16, 16), torch.randn(3, 32, 12)])
    with torch.no_grad():
        out = encoder(**kwargs, output_hidden_states=True)
        call, hidden = PixtralCall(encoder, kwargs), out.hidden_states[1]
        for index in (1, 2):
            hidden = call.layer(encoder.transformer.layers[index], index, hidden)
    torch.testing.assert_close(hidden, out.last_hidden_state, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="a Pixtral layer needs its call's 2D rotary positions and block mask"):
        run_encoder_layer(encoder.transformer.layers[1], hidden)


def test_pixtral_feature_count_refuses_images_above_the_tower():
    count = PixtralFeatureCount(patch_size=4, max_side=32)
    assert count((20, 32)) == 40 and count.max_patches == 64
    with pytest.raises(ValueError, match="larger than the Pixtral tower's maximum of 32 pixels per side"):
        count((36, 8))
    with pytest.raises(ValueError, match="smaller than one 4-pixel patch"):
        count((2, 8))


def test_internvl_features_equal_get_image_features():
    model = internvl_model()
    processor = tiling_processor()
    images = random_images([(24, 80), (16, 16), (70, 30)])
    batch = processor(images=images, return_tensors="pt")
    branch = ModalityEncoder(model.vision_tower, build_projector("linear", 128, 32), "image", select="drop_cls",
                             downsample=2)
    tiles = [processor(images=[img], return_tensors="pt")["pixel_values"] for img in images]
    sizes = [(int(t.shape[0]), 32, 32) for t in tiles]
    assert sizes == [(4, 32, 32), (1, 32, 32), (3, 32, 32)] and batch["num_patches"].tolist() == [4, 1, 3]
    stock, projector_input, mine = stock_projector_input(model, batch["pixel_values"], branch, tiles)
    assert [branch.feature_count(s) for s in sizes] == [64, 16, 48] and mine.shape == (128, 128)
    torch.testing.assert_close(mine, projector_input.reshape(-1, 128), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model.multi_modal_projector(mine), stock.reshape(-1, 32), rtol=1e-5, atol=1e-5)
    assert encoder_feature_size(model.vision_tower, 2) == 128 and encoder_layout(model.vision_tower).post_norm is None


def test_internvl_feature_count_pixel_shuffle_and_checks():
    count = InternVLFeatureCount(patch_size=4, tile=32, downsample=2, cls_tokens=0)
    assert count((5, 32, 32)) == 80 and InternVLFeatureCount(4, 32, 1, 1)((2, 32, 32)) == 2 * 65
    with pytest.raises(ValueError, match="gives 16x16 tiles, the InternVL tower expects 32x32"):
        count((1, 16, 16))
    with pytest.raises(ValueError, match="no tile count"):
        count((32, 32))
    with pytest.raises(ValueError, match="needs select = 'drop_cls'"):
        InternVLFeatureCount(4, 32, 2, 1)
    with pytest.raises(ValueError, match="does not divide the tower's 8x8 patch grid"):
        InternVLFeatureCount(4, 32, 16, 0)
    hidden = torch.arange(2 * 16 * 3, dtype=torch.float32).reshape(2, 16, 3)
    shuffled = pixel_shuffle_features(hidden, 2)
    assert shuffled.shape == (8, 12)
    torch.testing.assert_close(shuffled[0], torch.cat([hidden[0, 0], hidden[0, 1], hidden[0, 4], hidden[0, 5]]))
    branch = ModalityEncoder(build_encoder("image", config=dict(TINY_INTERNVL)), build_projector("linear", 128, 32),
                             "image", select="drop_cls", downsample=2)
    branch.check_item({"pixel_values": torch.zeros(3, 3, 32, 32)})
    with pytest.raises(ValueError, match="tiles of 3 channels x 16x16 pixels, the InternVL encoder expects 3 x 32x32"):
        branch.check_item({"pixel_values": torch.zeros(3, 3, 16, 16)})
    with pytest.raises(ValueError, match="expects tiles"):
        branch.check_item({"pixel_values": torch.zeros(3, 32, 32)})


def _flops_and_estimates(cfg, tower, inputs: dict, tokens: int) -> tuple[int, int]:
    with FlopCounterMode(display=False) as counter:
        tower(**inputs)
    llm = T.LlamaConfig(**config_kwargs(TINY_LLM), vocab_size=64)
    units = [u for u in units_from_configs({"v": encoder_arch(cfg), "llm": llm}) if u.module == "v" and u.kind != "projector"]
    est = unit_estimates(units, {"v": encoder_arch(cfg)}, MicrobatchShape(tokens=tokens))
    return counter.get_total_flops(), sum(e.weight_flops + e.attention_flops for e in est)


def test_cost_model_params_and_flops_equal_the_real_towers():
    pixtral = tiny_pixtral()
    assert model_param_count(encoder_arch(pixtral.config)) == sum(p.numel() for p in pixtral.parameters())
    measured, predicted = _flops_and_estimates(pixtral.config, pixtral, pixtral_inputs([torch.randn(3, 32, 32)]), 64)
    assert measured == predicted
    internvl = internvl_model().vision_tower
    assert model_param_count(encoder_arch(internvl.config)) == sum(p.numel() for p in internvl.parameters())
    measured, predicted = _flops_and_estimates(internvl.config, internvl, {"pixel_values": torch.randn(2, 3, 32, 32)},
                                               2 * 65)
    assert measured == predicted


@pytest.mark.parametrize("family, processor, message", [
    ("pixtral", {"size": {"longest_edge": 64}}, r"model.encoders.vision.processor.size.longest_edge = 64 is above "
                                                r"the Pixtral tower's image_size = 32"),
    ("pixtral", {"patch_size": 8}, r"model.encoders.vision.processor.patch_size = 8 but the Pixtral tower's "
                                   r"patch_size is 4"),
    ("internvl", {"size": {"height": 16, "width": 16}}, r"model.encoders.vision.processor.size = 16x16 but the "
                                                        r"InternVL tower's tiles are 32x32"),
])
def test_processor_that_cannot_fit_the_tower_is_refused_when_the_job_is_built(tmp_path, family, processor, message):
    from plait.models.registry import build_model, build_processor, load_tokenizer

    cfg = config_from_dict(vision_family_job(tmp_path, family, processor))
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tokenizer)
    with pytest.raises(ValueError, match=message):
        build_processor(cfg.model, model, tokenizer, 256)


def _composite(cfg: dict, feature_layer: int = -1, **branch) -> "MultimodalModel":
    from plait.models.hf import build_causal_lm
    from plait.models.multimodal import MultimodalModel

    torch.manual_seed(0)
    llm = build_causal_lm(config=TINY_LLM, vocab_size=50, attn_implementation="eager")
    encoder = build_encoder("image", config=cfg)
    projector = build_projector("mlp", encoder_feature_size(encoder, branch.get("downsample", 1)), 32)
    return MultimodalModel(llm, {"image": ModalityEncoder(encoder, projector, "image", feature_layer, **branch)},
                           {"image": 48})


@pytest.mark.parametrize("feature_layer", [-1, -2])
def test_pixtral_branch_split_at_every_unit_reproduces_its_features(feature_layer):
    from tests.helpers.stages import check_branch_chain

    model = _composite(dict(TINY_PIXTRAL, num_hidden_layers=3), feature_layer)
    inputs = {"pixel_values": [torch.randn(3, 20, 32), torch.randn(3, 16, 16), torch.randn(3, 32, 12)]}
    check_branch_chain(model, "image", inputs)


def test_internvl_branch_split_at_every_unit_reproduces_its_features():
    from tests.helpers.stages import check_branch_chain

    model = _composite(dict(TINY_INTERNVL, num_hidden_layers=3), select="drop_cls", downsample=2)
    inputs = {"pixel_values": [torch.randn(4, 3, 32, 32), torch.randn(1, 3, 32, 32)]}
    check_branch_chain(model, "image", inputs)


@pytest.mark.parametrize("family, processor, message", [
    ("pixtral", {"do_resize": False}, r"image of 24x40 pixels = 60 patches is larger than the Pixtral tower's "
                                      r"maximum of 32 pixels per side"),
    ("internvl", {"class": "SiglipImageProcessor", "size": {"height": 32, "width": 32}},
     r"the image processor gives pixel_values of shape \(3, 32, 32\), the InternVL encoder expects tiles"),
])
def test_bad_images_are_refused_naming_record_and_file(tmp_path, family, processor, message):
    from plait.data.sources import JsonlSource, SampleError, sample_at
    from plait.models.registry import build_model, build_processor, load_tokenizer

    cfg = config_from_dict(vision_family_job(tmp_path, family, processor))
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    mm = build_processor(cfg.model, build_model(cfg.model, tokenizer), tokenizer, 256)
    with pytest.raises(SampleError, match=rf"record 'wide-0'.*wide.png.*{message}"):
        mm(sample_at(JsonlSource(cfg.data.train), 0))


def _image_pair(tmp_path, sizes) -> tuple[list[str], dict]:
    """Two images of ``sizes`` saved as ``pair0.png``, ``pair1.png``, and a user turn asking about both."""
    paths = []
    for i, img in enumerate(random_images(sizes)):
        paths.append(str(tmp_path / f"pair{i}.png"))
        img.save(paths[-1])
    return paths, {"role": "user", "content": "<image> <image>\nSame digit?"}


def test_tiny_pixtral_job_with_two_images_of_different_sizes_trains(tmp_path):
    from plait.train.trainer import Trainer
    from tests.helpers.jobs import demo_records

    paths, ask = _image_pair(tmp_path, [(20, 36), (28, 12)])
    records = [{"id": "pair-0", "task": "pair", "images": paths,
                "messages": [ask, {"role": "assistant", "content": "no"}]}] + demo_records("train", ("image_digit",), 1)
    cfg = tiny_config_dict(str(write_jsonl(tmp_path / "train.jsonl", records)), None, str(tmp_path / "run"),
                           train={"steps": 2, "global_batch_size": 2, "microbatch_size": 2, "threads": 1})
    cfg["model"]["encoders"] = {"vision": {"modality": "image", "config": dict(TINY_PIXTRAL)}}
    trainer = Trainer.build(config_from_dict(cfg))
    # 20x36 is resized to 20x32 (longest edge 32): 5x8 patches; 28x12: 7x3
    assert trainer.train_set[0].meta.items == (("vision", 40), ("vision", 21))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.fit()
    assert len(result["losses"]) == 2 and all(np.isfinite(result["losses"]))
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert "encoders.vision.encoder.patch_conv.weight" in moved


def test_tiny_internvl_job_tiles_images_of_different_sizes_and_trains(tmp_path):
    from plait.data.collate import collate
    from plait.train.trainer import Trainer

    paths, ask = _image_pair(tmp_path, [(24, 80), (16, 16)])
    records = [{"id": f"pair-{k}", "task": "pair", "images": pair, "messages": [ask, {"role": "assistant",
                                                                                     "content": "no"}]}
               for k, pair in enumerate([paths, paths[::-1]])]
    cfg = tiny_config_dict(str(write_jsonl(tmp_path / "train.jsonl", records)), None, str(tmp_path / "run"),
                           train={"steps": 2, "global_batch_size": 2, "microbatch_size": 2, "threads": 1})
    cfg["model"]["encoders"] = {"vision": {"modality": "image", "config": dict(TINY_INTERNVL), "select": "drop_cls",
                                           "downsample": 2, "processor": {"max_patches": 6}}}
    trainer = Trainer.build(config_from_dict(cfg))
    # 24x80: 3x1 tiles + thumbnail = 4 tiles of 16 features; 16x16: one tile (no thumbnail)
    assert trainer.train_set[0].meta.items == (("vision", 64), ("vision", 16))
    batch = collate([trainer.train_set[0], trainer.train_set[1]], pad_id=0)
    tiles = [int(p.shape[0]) for p in batch.modality_inputs["vision"]["pixel_values"]]
    assert tiles == [4, 1, 1, 4] and {tuple(p.shape[1:]) for p in batch.modality_inputs["vision"]["pixel_values"]} == {
        (3, 32, 32)}
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.fit()
    assert len(result["losses"]) == 2 and all(np.isfinite(result["losses"]))
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert "encoders.vision.encoder.embeddings.patch_embeddings.projection.weight" in moved
    assert trainer.model.encoders["vision"].projector.linear_1.in_features == 128


def test_pixtral_split_tower_under_activation_checkpointing_gives_the_same_gradients():
    from plait.models.units import model_units
    from plait.parallel.activation_checkpointing import apply_activation_checkpointing
    from plait.parallel.stages import build_rank_stages
    from plait.planner.pipeline.plan import plan_pipeline
    from tests.distributed.pipeline_worker import make_batch
    from tests.helpers.stages import on_one_rank

    inputs = {"pixel_values": [torch.randn(3, 20, 32), torch.randn(3, 16, 16)]}
    reference = _composite(dict(TINY_PIXTRAL, num_hidden_layers=3))
    reference.encoders["image"](inputs).square().sum().backward()
    model = _composite(dict(TINY_PIXTRAL, num_hidden_layers=3))
    assert apply_activation_checkpointing(model, "full") == [f"encoders.image.encoder.transformer.layers.{i}"
                                                             for i in range(3)] + [
        f"language_model.model.layers.{i}" for i in range(2)]
    plan = on_one_rank(plan_pipeline(model_units(model),
                                     splits={"image": ["encoders.image.encoder.transformer.layers.1"]}))
    stages = build_rank_stages(model, plan, 0)
    batch = make_batch("t", 0)
    batch.modality_inputs = {"image": inputs}
    first, second = (stages.stages[i] for i in plan.module_stages("image"))
    out = second.forward(batch, {first.index: first.forward(batch, {}, None, {})}, None, {})
    out["image"][0].square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if n.startswith("encoders.")}
    for name, param in reference.named_parameters():
        if name.startswith("encoders."):
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_pixtral_tp_plan_covers_every_linear_of_a_layer_and_internvl_has_none():
    from plait.models.hf import encoder_tp_plan

    encoder = tiny_pixtral()
    plan = encoder_tp_plan(encoder)
    linears = {f"transformer.layers.*.{n}" for n, m in encoder.transformer.layers[0].named_modules()
               if isinstance(m, torch.nn.Linear)}
    assert set(plan) == linears and plan["transformer.layers.*.attention.o_proj"] == "rowwise"
    with pytest.raises(ValueError, match="no tensor-parallel plan for encoder model_type 'internvl_vision'"):
        encoder_tp_plan(build_encoder("image", config=dict(TINY_INTERNVL)))


def test_a_full_internvl_checkpoint_gives_its_tower_and_tiling_processor(tmp_path):
    from plait.models.registry import build_model, build_processor, load_tokenizer

    full = T.InternVLForConditionalGeneration(internvl_model().config)
    full.save_pretrained(tmp_path / "internvl")
    tiling_processor().__class__(size={"height": 32, "width": 32}).save_pretrained(tmp_path / "internvl")
    job = vision_family_job(tmp_path, "internvl", {})
    job["model"]["encoders"]["vision"] = {"modality": "image", "path": str(tmp_path / "internvl"),
                                          "select": "drop_cls", "downsample": 2}
    cfg = config_from_dict(job)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tokenizer)
    tower = model.encoders["vision"].encoder
    assert tower.config.model_type == "internvl_vision"
    loaded = build_encoder("image", path=str(tmp_path / "internvl")).state_dict()  # from_pretrained's key mapping
    for name, value in full.model.vision_tower.state_dict().items():
        torch.testing.assert_close(tower.state_dict()[name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
    processor = build_processor(cfg.model, model, tokenizer, 256).specs["image"].hf_processor
    assert processor.crop_to_patches and processor(images=random_images([(24, 80)]), return_tensors="pt")[
        "num_patches"].tolist() == [4]


def test_a_pixtral_path_towers_processor_table_is_applied_and_checked(tmp_path):
    """The job's ``processor`` table goes over the processor saved in the tower's ``path`` folder (it was ignored)."""
    from plait.models.registry import build_model, build_processor, load_tokenizer

    folder = tmp_path / "pixtral"
    build_encoder("image", config=dict(TINY_PIXTRAL)).save_pretrained(folder)
    T.PixtralImageProcessorPil(patch_size=4, size={"longest_edge": 32}).save_pretrained(folder)

    def processor(table: dict):
        job = vision_family_job(tmp_path, "pixtral", table)
        job["model"]["encoders"]["vision"] = {"modality": "image", "path": str(folder), "processor": table}
        cfg = config_from_dict(job)
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        return build_processor(cfg.model, build_model(cfg.model, tokenizer), tokenizer, 256).specs["image"]

    assert processor({"size": {"longest_edge": 16}}).hf_processor.size["longest_edge"] == 16
    with pytest.raises(ValueError, match=r"model.encoders.vision.processor.size.longest_edge = 64 is above the "
                                         r"Pixtral tower's image_size = 32"):
        processor({"size": {"longest_edge": 64}})
