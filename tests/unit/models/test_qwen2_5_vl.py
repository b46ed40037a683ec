"""Qwen2.5-VL vision branch: images of different sizes packed in one call, merged features equal to transformers'
own ``Qwen2_5_VLModel.get_image_features`` (fp32, 1e-5), the feature count shared with the processor, the
per-call hook (``models.tower_call``) reproducing the stock forward block by block, bad input refused clearly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T
from PIL import Image

from plait.models.encoder import ModalityEncoder
from plait.models.families.qwen2_5_vl import MAX_PIXELS, Qwen25VLFeatureCount, check_qwen2_5_vl_processor
from plait.models.hf import build_encoder, encoder_feature_size, encoder_layout
from plait.models.projector import build_projector
from plait.models.tower_call import tower_call
from tests.helpers.qwen2_5_vl import TINY_PROCESSOR, TINY_QWEN2_5_VL

BRANCH_CONFIG = {"modality": "image", "config": dict(TINY_QWEN2_5_VL), "projector": "linear",
                 "processor": dict(TINY_PROCESSOR)}


def tiny_images(sizes=((100, 150), (60, 60), (150, 90))) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def _branch(seed: int = 0) -> ModalityEncoder:
    torch.manual_seed(seed)
    encoder = build_encoder("image", config=dict(TINY_QWEN2_5_VL)).eval()
    return ModalityEncoder(encoder, build_projector("linear", 48, 32), "image")


def _processed(processor, images):
    out = [processor(images=[img], return_tensors="pt") for img in images]
    return {"pixel_values": [o["pixel_values"] for o in out], "image_grid_thw": [o["image_grid_thw"][0] for o in out]}


def test_merged_features_equal_hf_get_image_features():
    branch = _branch()
    cfg = T.Qwen2_5_VLConfig(vision_config={k: v for k, v in TINY_QWEN2_5_VL.items() if k != "model_type"},
                             text_config=dict(hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    hf = T.Qwen2_5_VLModel(cfg).eval()
    hf.visual.load_state_dict(branch.encoder.state_dict())
    processor = T.Qwen2VLImageProcessorPil(**TINY_PROCESSOR)
    batch = processor(images=tiny_images(), return_tensors="pt")
    inputs = _processed(processor, tiny_images())
    with torch.no_grad():
        stock = hf.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
        mine = branch.encoder_forward(inputs)
    grids = [tuple(g.tolist()) for g in inputs["image_grid_thw"]]
    assert grids == [tuple(g) for g in batch["image_grid_thw"].tolist()]
    counts = [branch.feature_count(g) for g in grids]
    assert [s.shape[0] for s in stock] == counts and len(set(counts)) == 3
    assert mine.shape == (sum(counts), 48) and encoder_feature_size(branch.encoder, 1) == 48
    torch.testing.assert_close(mine, torch.cat(stock), rtol=1e-5, atol=1e-5)
    assert len(branch.item_groups(inputs)) == 1 and encoder_layout(branch.encoder).post_norm == "merger"


def test_tower_call_runs_the_blocks_one_by_one_like_the_stock_forward():
    branch = _branch()
    encoder = branch.encoder
    inputs = _processed(T.Qwen2VLImageProcessorPil(**TINY_PROCESSOR), tiny_images())
    (kwargs, _), = branch.item_groups(inputs)
    call = tower_call(encoder, kwargs)
    with torch.no_grad():
        stock = encoder(**kwargs)
        hidden = encoder.permute_input_for_window_attn(encoder.patch_embed(kwargs["hidden_states"]),
                                                       call._pre["window_index"], kwargs["hidden_states"].shape[0])
        for index, block in enumerate(encoder.blocks):
            hidden = call.layer(block, index, hidden)
        merged = call.post_norm(encoder.merger, hidden)
    torch.testing.assert_close(hidden, stock.last_hidden_state, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged, call.stock_output(stock, True), rtol=1e-5, atol=1e-6)


def test_feature_count_and_its_errors():
    count = Qwen25VLFeatureCount(2, MAX_PIXELS // 14**2)
    assert count((1, 8, 10)) == 20 and count((8, 10)) == 20 and count((2, 4, 4)) == 8
    with pytest.raises(ValueError, match="not a multiple of the Qwen2.5-VL tower's 2x2 merge blocks"):
        count((1, 5, 4))
    with pytest.raises(ValueError, match="larger than the Qwen2.5-VL tower's maximum of 65536 patches"):
        count((1, 512, 130))
    with pytest.raises(ValueError, match="has no patch"):
        count((0, 2, 2))


def test_processor_mismatch_is_refused_naming_the_field():
    cfg = build_encoder("image", config=dict(TINY_QWEN2_5_VL)).config
    check_qwen2_5_vl_processor(T.Qwen2VLImageProcessorPil(**TINY_PROCESSOR), cfg)
    with pytest.raises(ValueError, match=r"processor.patch_size = 16 but the Qwen2.5-VL tower's patch_size is 14"):
        check_qwen2_5_vl_processor(T.Qwen2VLImageProcessorPil(patch_size=16), cfg)
    with pytest.raises(ValueError, match=r"processor.max_pixels = 20000000 is above the Qwen2.5-VL tower's maximum"):
        check_qwen2_5_vl_processor(T.Qwen2VLImageProcessorPil(max_pixels=20_000_000), cfg)


def test_encoder_input_check_names_patch_width_and_rows():
    check = _branch().check_item
    processor = T.Qwen2VLImageProcessorPil(**TINY_PROCESSOR)
    out = processor(images=tiny_images()[:1], return_tensors="pt")
    item = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"][0]}
    check(item)
    with pytest.raises(ValueError, match="patches of 588 values, the Qwen2.5-VL encoder expects 1176"):
        check({**item, "pixel_values": item["pixel_values"][:, :588]})
    with pytest.raises(ValueError, match="expected 80 rows"):
        check({**item, "pixel_values": item["pixel_values"][:40]})


def _model(seed: int = 0):
    from plait.models.hf import build_causal_lm
    from plait.models.multimodal import MultimodalModel
    from tests.helpers.jobs import TINY_LLM

    torch.manual_seed(seed)
    llm = build_causal_lm(config=TINY_LLM, vocab_size=50, attn_implementation="eager")
    return MultimodalModel(llm, {"image": _branch(seed)}, {"image": 48})


def _inputs() -> dict:
    return _processed(T.Qwen2VLImageProcessorPil(**TINY_PROCESSOR), tiny_images())


def test_branch_split_at_every_unit_reproduces_its_features():
    from tests.helpers.stages import check_branch_chain

    check_branch_chain(_model(), "image", _inputs())


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_split_inside_the_blocks_gives_the_features_and_gradients_of_one_module(checkpointing):
    """Stages [patch_embed + blocks 0, 1] | [blocks 2, 3 (full attention in 3), merger, projector], with and without
    activation checkpointing of the blocks: features and every encoder gradient equal the unsplit branch's."""
    from plait.models.units import model_units
    from plait.parallel.activation_checkpointing import apply_activation_checkpointing
    from plait.parallel.stages import build_rank_stages
    from plait.planner.pipeline.plan import plan_pipeline
    from tests.distributed.pipeline_worker import make_batch
    from tests.helpers.stages import on_one_rank

    reference, model = _model(), _model()
    inputs = _inputs()
    expected = reference.encoders["image"](inputs)
    expected.pow(2).sum().backward()
    done = apply_activation_checkpointing(model, checkpointing)
    assert sum(".blocks." in name for name in done) == (4 if checkpointing == "full" else 0)
    plan = on_one_rank(plan_pipeline(model_units(model), splits={"image": ["encoders.image.encoder.blocks.2"]}))
    stages = build_rank_stages(model, plan, 0)
    batch = make_batch("t", 0)
    batch.modality_inputs = {"image": inputs}
    first, second = (stages.stages[i] for i in plan.module_stages("image"))
    hidden = first.forward(batch, {}, None, {})
    patches = sum(int(g.prod()) for g in inputs["image_grid_thw"])  # window-ordered patches travel between stages
    assert hidden["image"][0].shape == (patches, 32) and patches == 4 * expected.shape[0]
    out = second.forward(batch, {first.index: hidden}, None, {})["image"][0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.pow(2).sum().backward()
    ref = dict(reference.encoders["image"].named_parameters())
    for name, param in model.encoders["image"].named_parameters():
        torch.testing.assert_close(param.grad, ref[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_cost_model_params_and_flops_equal_the_real_tower():
    """Two images of 8x8 patches (4 windows of 4x4 patches each): window layers attend 16 patches, full layers 64."""
    from torch.utils.flop_counter import FlopCounterMode

    from plait.models.plan_inputs import encoder_arch
    from plait.planner.cost.arch import model_param_count, projector_arch, split_model_configs, units_from_configs
    from plait.planner.cost.analytic import unit_estimates
    from plait.planner.cost.types import MicrobatchShape
    from tests.helpers.jobs import TINY_LLM

    kwargs = {k: v for k, v in TINY_QWEN2_5_VL.items() if k != "model_type"}
    cfg = T.Qwen2_5_VLConfig(vision_config=kwargs).vision_config
    cfg._attn_implementation = "eager"  # the flop counter sees eager attention's matmuls (not CPU SDPA's kernel)
    tower = T.Qwen2_5_VisionTransformerPretrainedModel(cfg)
    arch = encoder_arch(cfg)  # the family's facts, as the planner receives them
    assert model_param_count(arch) == sum(p.numel() for p in tower.parameters())
    grid = torch.tensor([[1, 8, 8], [1, 8, 8]])
    with FlopCounterMode(display=False) as counter:
        tower(torch.randn(128, 1176), grid_thw=grid)
    llm = T.LlamaConfig(**{k: v for k, v in TINY_LLM.items() if k != "model_type"}, vocab_size=64)
    units = [u for u in units_from_configs({"v": arch, "llm": llm}) if u.module == "v"]
    est = unit_estimates([u for u in units if u.kind != "projector"], {"v": arch},
                         MicrobatchShape(tokens=128, seq_len=64))
    assert counter.get_total_flops() == sum(e.weight_flops + e.attention_flops for e in est)
    archs, _ = split_model_configs({"v": arch, "llm": llm})
    assert projector_arch("v", archs, {}).in_dim == 48 and [u.kind for u in units][-2:] == ["norm", "projector"]


def test_whole_model_logits_equal_hf_where_positions_allow():
    """plait's composite (the tower, an identity projector, Qwen2ForCausalLM with the text weights) equals
    ``Qwen2_5_VLForConditionalGeneration`` given 1-D positions (its M-RoPE with three equal streams is 1-D RoPE).
    With Hugging Face's own multimodal positions (``get_rope_index``: image tokens at (t, h, w) grid positions) an
    imported composite (Qwen2.5-VL's text model, the collator's M-RoPE positions) equals it:
    tests/unit/models/test_hf_io_qwen2_5_vl.py."""
    vision = {k: v for k, v in TINY_QWEN2_5_VL.items() if k != "model_type"}
    text = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                       "mrope_section": [4, 4, 4]})
    torch.manual_seed(0)
    hf = T.Qwen2_5_VLForConditionalGeneration(T.Qwen2_5_VLConfig(
        vision_config=vision, text_config=dict(text, bos_token_id=None, eos_token_id=None), image_token_id=60)).eval()
    from plait.models.multimodal import MultimodalModel

    tc = hf.config.text_config
    llm = T.Qwen2ForCausalLM(T.Qwen2Config(hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                           rms_norm_eps=tc.rms_norm_eps, rope_theta=10000.0,
                                           tie_word_embeddings=hf.config.tie_word_embeddings,
                                           bos_token_id=None, eos_token_id=None)).eval()
    missing, unexpected = llm.model.load_state_dict(hf.model.language_model.state_dict(), strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k]
    llm.lm_head.load_state_dict(hf.lm_head.state_dict())
    branch = ModalityEncoder(build_encoder("image", config=dict(TINY_QWEN2_5_VL)), build_projector("linear", 48, 48),
                             "image")
    branch.encoder.load_state_dict(hf.model.visual.state_dict())
    with torch.no_grad():
        branch.projector.linear_1.weight.copy_(torch.eye(48))
        branch.projector.linear_1.bias.zero_()
    model = MultimodalModel(llm, {"image": branch}, {"image": 60}).eval()
    processor = T.Qwen2VLImageProcessorPil(**TINY_PROCESSOR)
    images = tiny_images()[:2]
    batch = processor(images=images, return_tensors="pt")
    counts = [branch.feature_count(tuple(g)) for g in batch["image_grid_thw"].tolist()]
    ids = torch.tensor([[1, 5] + [60] * counts[0] + [7, 8] + [60] * counts[1] + [9, 10, 11]])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        stock = hf(input_ids=ids, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                   position_ids=positions).logits
        mine = model(ids, {"image": _processed(processor, images)}, position_ids=positions)
    torch.testing.assert_close(mine, stock, rtol=1e-5, atol=1e-5)


def test_video_temporal_patches_join_consecutive_frames():
    """Three frames -> one item of 2 temporal patches (the last frame repeated), t*h*w/4 features; two equal frames
    give exactly the image processor's rows of that frame (an image is its frame in every temporal slot)."""
    from plait.models.families.qwen2_5_vl import TemporalPatches

    branch = _branch()
    encoding = branch.video_encoding
    assert encoding == TemporalPatches(2)
    processor = T.Qwen2VLImageProcessorPil(**TINY_PROCESSOR)
    rng = np.random.default_rng(3)
    frames = [Image.fromarray(rng.integers(0, 255, (100, 150, 3), dtype=np.uint8)) for _ in range(3)]
    (item, size), = encoding.items(processor, frames)
    frame = processor(images=[frames[0]], return_tensors="pt")
    h, w = (int(d) for d in frame["image_grid_thw"][0, 1:])
    assert size == (2, h, w) == tuple(item["image_grid_thw"].tolist())
    assert encoding.sizes(3, (1, h, w)) == [size] and branch.feature_count(size) == 2 * h * w // 4
    rows = item["pixel_values"].reshape(2, h * w, 3, 2, 14 * 14)
    per_frame = [processor(images=[f], return_tensors="pt")["pixel_values"].reshape(h * w, 3, 2, 196) for f in frames]
    torch.testing.assert_close(rows[0, :, :, 0], per_frame[0][:, :, 0])
    torch.testing.assert_close(rows[0, :, :, 1], per_frame[1][:, :, 1])
    torch.testing.assert_close(rows[1, :, :, 0], per_frame[2][:, :, 0])
    torch.testing.assert_close(rows[1, :, :, 1], per_frame[2][:, :, 1])
    (still, _), = encoding.items(processor, [frames[0], frames[0]])
    torch.testing.assert_close(still["pixel_values"], frame["pixel_values"])
    branch.check_item(item)
    with torch.no_grad():
        features = branch.encoder_forward({"pixel_values": [item["pixel_values"]],
                                           "image_grid_thw": [item["image_grid_thw"]]})
    assert features.shape == (2 * h * w // 4, 48)


def test_full_checkpoint_gives_its_vision_tower(tmp_path):
    vision = {k: v for k, v in TINY_QWEN2_5_VL.items() if k != "model_type"}
    text = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=64, bos_token_id=None, eos_token_id=None)
    hf = T.Qwen2_5_VLForConditionalGeneration(T.Qwen2_5_VLConfig(vision_config=vision, text_config=text))
    hf.save_pretrained(tmp_path)
    tower = build_encoder("image", path=str(tmp_path))
    expected = hf.model.visual.state_dict()
    assert set(tower.state_dict()) == set(expected)
    for name, value in tower.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_meta_build_and_each_ranks_share_equal_the_full_model():
    """The composite built on meta and materialised equals the eager build; each rank of a plan cutting the tower in
    two (vision stages 2, audio 1, LLM 1) materialises only its units, with the full model's values (the rotary
    table rides with the patch embedding)."""
    from plait.config.loader import config_from_dict
    from plait.models.registry import build_model, load_tokenizer
    from tests.helpers.jobs import tiny_config_dict
    from tests.helpers.meta_init import SEED, assert_same, check_ranks, eager_reference, tensors

    cfg_dict = tiny_config_dict("unused.jsonl")
    cfg_dict["model"]["encoders"]["vision"] = dict(BRANCH_CONFIG)
    cfg = config_from_dict(cfg_dict).model
    tokenizer = load_tokenizer(cfg_dict["data"]["tokenizer"])
    full = build_model(cfg, tokenizer, seed=SEED)
    assert_same(tensors(full), tensors(eager_reference(cfg, tokenizer)))
    check_ranks(cfg, tokenizer, full, {"vision": 2, "audio": 1, "llm": 1})


def _job(tmp_path, records, processor=None, steps=2, **tower) -> dict:
    from tests.helpers.jobs import tiny_config_dict, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", records)
    cfg = tiny_config_dict(str(data), None, str(tmp_path / "run"),
                           train={"steps": steps, "global_batch_size": 2, "microbatch_size": 1, "threads": 1})
    branch = dict(BRANCH_CONFIG, config=dict(TINY_QWEN2_5_VL, **tower))
    branch["processor"] = dict(TINY_PROCESSOR, **(processor or {}))
    cfg["model"]["encoders"] = {"vision": branch}
    return cfg


def _two_image_records(tmp_path) -> list[dict]:
    paths = []
    for i, img in enumerate(tiny_images()):
        paths.append(str(tmp_path / f"img{i}.png"))
        img.save(paths[-1])
    ask = {"role": "user", "content": "<image> <image>\nSame digit?"}
    return [{"id": f"pair-{k}", "task": "pair", "images": pair, "messages": [ask, {"role": "assistant", "content": a}]}
            for k, (pair, a) in enumerate([((paths[0], paths[1]), "no"), ((paths[2], paths[0]), "yes")])]


def test_tiny_job_with_several_images_of_different_sizes_trains(tmp_path):
    from plait.config.loader import config_from_dict
    from plait.data.collate import collate
    from plait.train.trainer import Trainer
    from tests.helpers.jobs import demo_records

    records = _two_image_records(tmp_path) + demo_records("train", ("image_digit",), limit=2)
    trainer = Trainer.build(config_from_dict(_job(tmp_path, records, steps=3)))
    metas = [trainer.train_set[i].meta.items for i in (0, 1)]
    assert metas == [(("vision", 20), ("vision", 4)), (("vision", 15), ("vision", 20))]
    batch = collate([trainer.train_set[0], trainer.train_set[1]], pad_id=0)
    grids = [tuple(g.tolist()) for g in batch.modality_inputs["vision"]["image_grid_thw"]]
    assert grids == [(1, 8, 10), (1, 4, 4), (1, 10, 6), (1, 8, 10)]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.fit()
    assert len(result["losses"]) == 3 and all(np.isfinite(result["losses"]))
    moved = {n.split(".")[3] for n, p in trainer.model.named_parameters()
             if n.startswith("encoders.vision.encoder.") and not torch.equal(p, before[n])}
    assert moved == {"patch_embed", "blocks", "merger"}


def test_bad_input_is_refused_naming_record_and_file_or_field(tmp_path):
    from plait.config.loader import config_from_dict
    from plait.data.sources import JsonlSource, SampleError, sample_at
    from plait.models.registry import build_model, build_processor, load_tokenizer

    records = _two_image_records(tmp_path)
    cfg = config_from_dict(_job(tmp_path, records, in_channels=1))  # a grey tower fed the processor's RGB patches
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tokenizer)
    mm = build_processor(cfg.model, model, tokenizer, 256)
    with pytest.raises(SampleError, match=r"record 'pair-0'.*img0.png.*patches of 1176 values, the Qwen2.5-VL "
                                          r"encoder expects 392"):
        mm(sample_at(JsonlSource(cfg.data.train), 0))
    cfg = config_from_dict(_job(tmp_path, records, {"max_pixels": 13_000_000}))
    model = build_model(cfg.model, tokenizer)
    with pytest.raises(ValueError, match=r"model.encoders.vision.processor.max_pixels = 13000000 is above the "
                                         r"Qwen2.5-VL tower's maximum of 12845056"):
        build_processor(cfg.model, model, tokenizer, 256)


def test_video_record_is_one_item_of_temporal_patches_and_trains(tmp_path):
    """A 6-frame video sampled at 2 fps (frames 0, 2, 4) is one item of grid (2, h, w) in the processor, the
    metadata pass (headers only) and the batch; a job mixing it with images trains."""
    from plait.config.loader import config_from_dict
    from plait.data.metadata import record_metadata
    from plait.data.sources import parse_record
    from plait.train.trainer import Trainer
    from tests.media import video_tokenizer, write_video

    video = write_video(tmp_path / "fade.mp4", 6, width=64, height=48)
    rec = {"id": "v1", "images": [], "videos": [str(video)],
           "messages": [{"role": "user", "content": "<video>\nWhat happens?"},
                        {"role": "assistant", "content": "it fades"}]}
    records = [rec] + _two_image_records(tmp_path)
    job = _job(tmp_path, records, steps=2)
    job["data"]["tokenizer"] = str(video_tokenizer(tmp_path / "tok"))
    job["model"]["encoders"]["vision"]["video"] = {"fps": 2.0, "max_frames": 4}
    trainer = Trainer.build(config_from_dict(job))
    sample = trainer.train_set[0]
    (item,) = sample.inputs["vision"]
    t, h, w = (int(g) for g in item["image_grid_thw"])
    assert t == 2 and sample.meta.items == (("vision", t * h * w // 4),)
    assert record_metadata(trainer.processor, parse_record(rec, "t.jsonl:1", tmp_path)) == sample.meta
    result = trainer.fit()
    assert len(result["losses"]) == 2 and all(np.isfinite(result["losses"]))


def test_frozen_tower_units_keep_no_graph_and_its_projector_trains():
    """Frozen tower, trainable projector: the tower's units neither train nor need input gradients, a stage split
    inside the blocks runs them without autograd, and only the projector receives gradients."""
    from plait.models.units import model_units
    from plait.parallel.stages import build_rank_stages
    from plait.planner.pipeline.plan import plan_pipeline
    from tests.distributed.pipeline_worker import make_batch
    from tests.helpers.stages import on_one_rank

    model = _model()
    model.set_frozen("encoder", True, "image")
    units = [u for u in model_units(model) if u.module == "image"]
    frozen = [("embed", False, False)] + [("layer", False, False)] * 4 + [("norm", False, False)]
    assert [(u.kind, u.trainable, u.needs_input_grad) for u in units] == frozen + [("projector", True, False)]
    plan = on_one_rank(plan_pipeline(model_units(model), splits={"image": ["encoders.image.encoder.blocks.2"]}))
    stages = build_rank_stages(model, plan, 0)
    batch = make_batch("t", 0)
    batch.modality_inputs = {"image": _inputs()}
    first, second = (stages.stages[i] for i in plan.module_stages("image"))
    hidden = first.forward(batch, {}, None, {})
    assert hidden["image"][0].grad_fn is None
    out = second.forward(batch, {first.index: hidden}, None, {})["image"][0]
    out.sum().backward()
    grads = {n for n, p in model.encoders["image"].named_parameters() if p.grad is not None}
    assert grads == {"projector.linear_1.weight", "projector.linear_1.bias"}


def test_text_causal_lm_builds_no_throwaway_qwen2_model(monkeypatch):
    """``Qwen25VLTextForCausalLM`` builds only its M-RoPE decoder stack (no ``Qwen2Model`` made and replaced), with
    ``Qwen2_5_VLForConditionalGeneration``'s ``language_model`` / ``lm_head`` names and shapes."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Model

    from plait.models.families.qwen2_5_vl import Qwen25VLTextForCausalLM
    from tests.helpers.qwen2_5_vl_parallel import MROPE_LLM

    def refuse(self, *args, **kwargs):
        raise AssertionError("a Qwen2Model was built")

    monkeypatch.setattr(Qwen2Model, "__init__", refuse)
    config = T.Qwen2_5_VLTextConfig(**{k: v for k, v in MROPE_LLM.items() if k != "model_type"}, vocab_size=50)
    model = Qwen25VLTextForCausalLM(config)
    assert type(model.model) is T.Qwen2_5_VLTextModel and model.vocab_size == 50
    assert model.lm_head.weight.shape == (50, 32) and model.lm_head.bias is None
    hf = T.Qwen2_5_VLForConditionalGeneration(T.Qwen2_5_VLConfig(text_config=config.to_dict(),
                                                                  vision_config=TINY_QWEN2_5_VL))
    theirs = {k.removeprefix("model.language_model."): v.shape for k, v in hf.state_dict().items()
              if k.startswith(("model.language_model.", "lm_head."))}
    ours = {k.removeprefix("model."): v.shape for k, v in model.state_dict().items()}
    assert ours == theirs
