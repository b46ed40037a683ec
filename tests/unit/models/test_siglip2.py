"""SigLIP2 NaFlex branch: images of different sizes in one batch (variable patch counts), features equal to the
stock ``Siglip2VisionModel`` on the processor's padded batch (fp32, 1e-5), feature count shared with the
processor, cost model equal to the real module, a tiny job trains, bad input names record and file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode

from plait.config.loader import config_from_dict
from plait.data.collate import collate
from plait.data.processing import process_image
from plait.data.sources import JsonlSource, SampleError, sample_at
from plait.models.encoder import ModalityEncoder
from plait.models.families.siglip2 import Siglip2FeatureCount
from plait.models.hf import build_encoder, encoder_layout
from plait.models.projector import build_projector
from plait.models.plan_inputs import encoder_arch
from plait.planner.cost.arch import model_param_count, units_from_configs
from plait.planner.cost.analytic import unit_estimates
from plait.planner.cost.types import MicrobatchShape
from tests.helpers.jobs import TINY_LLM, demo_records, tiny_config_dict, write_jsonl
from tests.helpers.siglip2 import TINY_SIGLIP2


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in [(24, 40), (16, 16), (40, 24)]]


def test_features_equal_stock_siglip2_on_the_padded_batch():
    torch.manual_seed(0)
    kwargs = {k: v for k, v in TINY_SIGLIP2.items() if k != "model_type"}
    encoder = T.Siglip2VisionModel(T.Siglip2VisionConfig(**kwargs, attn_implementation="eager")).eval()
    processor = T.Siglip2ImageProcessorPil(patch_size=4, max_num_patches=16)
    padded = processor(images=_images(), return_tensors="pt")
    branch = ModalityEncoder(encoder, build_projector("linear", 32, 32), "image", feature_layer=-1)
    items = [process_image(processor, img) for img in _images()]
    sizes = [size for _, size in items]
    assert sizes == [tuple(s) for s in padded["spatial_shapes"].tolist()] == [(3, 5), (4, 4), (5, 3)]
    inputs = {"pixel_values": [it["pixel_values"] for it, _ in items],
              "spatial_shapes": [it["spatial_shapes"] for it, _ in items]}
    with torch.no_grad():
        stock = encoder(**padded, output_hidden_states=True).hidden_states[-1]
        mine = branch.encoder_forward(inputs)
    counts = [branch.feature_count(s) for s in sizes]
    reference = torch.cat([stock[i, :c] for i, c in enumerate(counts)])
    assert mine.shape == (15 + 16 + 15, 32)
    torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
    assert len(branch.item_groups(inputs)) == 3 and encoder_layout(encoder).post_norm == "post_layernorm"


def test_feature_count_and_checks():
    count = Siglip2FeatureCount(16)
    assert count((3, 5)) == 15
    with pytest.raises(ValueError, match="5x4 = 20 patches is larger than the SigLIP2 tower's maximum of 16"):
        count((5, 4))
    branch = ModalityEncoder(build_encoder("image", config=dict(TINY_SIGLIP2)), build_projector("linear", 32, 32),
                             "image")
    branch.check_item({"pixel_values": torch.zeros(6, 48), "spatial_shapes": torch.tensor([2, 3])})
    with pytest.raises(ValueError, match="patches of 192 values, the SigLIP2 encoder expects 48"):
        branch.check_item({"pixel_values": torch.zeros(6, 192), "spatial_shapes": torch.tensor([2, 3])})


def test_cost_model_params_and_flops_equal_the_real_tower():
    kwargs = {k: v for k, v in TINY_SIGLIP2.items() if k != "model_type"}
    cfg = T.Siglip2VisionConfig(**kwargs, attn_implementation="eager", vision_use_head=False)
    tower = T.Siglip2VisionModel(cfg)
    arch = encoder_arch(cfg)  # the family's facts, as the planner receives them
    assert model_param_count(arch) == sum(p.numel() for p in tower.parameters())
    with FlopCounterMode(display=False) as counter:
        tower(pixel_values=torch.randn(2, 16, 48), pixel_attention_mask=torch.ones(2, 16, dtype=torch.long),
              spatial_shapes=torch.tensor([[4, 4], [4, 4]]))
    llm = T.LlamaConfig(**{k: v for k, v in TINY_LLM.items() if k != "model_type"}, vocab_size=64)
    units = [u for u in units_from_configs({"v": arch, "llm": llm}) if u.module == "v" and u.kind != "projector"]
    est = unit_estimates(units, {"v": arch}, MicrobatchShape(tokens=2 * 16))
    assert counter.get_total_flops() == sum(e.weight_flops + e.attention_flops for e in est)


def _job(tmp_path, records, processor=None, steps=2) -> dict:
    data = write_jsonl(tmp_path / "train.jsonl", records)
    cfg = tiny_config_dict(str(data), None, str(tmp_path / "run"),
                           train={"steps": steps, "global_batch_size": 2, "microbatch_size": 1, "threads": 1})
    cfg["model"]["encoders"] = {"vision": {"modality": "image", "config": dict(TINY_SIGLIP2),
                                           "processor": processor or {}}}
    return cfg


def _two_image_records(tmp_path) -> list[dict]:
    paths = []
    for i, img in enumerate(_images()):
        paths.append(str(tmp_path / f"img{i}.png"))
        img.save(paths[-1])
    ask = {"role": "user", "content": "<image> <image>\nSame digit?"}
    return [{"id": f"pair-{k}", "task": "pair", "images": pair, "messages": [ask, {"role": "assistant", "content": a}]}
            for k, (pair, a) in enumerate([((paths[0], paths[1]), "no"), ((paths[2], paths[0]), "yes")])]


def test_tiny_siglip2_job_with_several_images_of_different_sizes_trains(tmp_path):
    from plait.train.trainer import Trainer

    records = _two_image_records(tmp_path) + demo_records("train", ("image_digit",), limit=2)
    trainer = Trainer.build(config_from_dict(_job(tmp_path, records, steps=3)))
    metas = [trainer.train_set[i].meta.items for i in (0, 1)]
    assert metas == [(("vision", 15), ("vision", 16)), (("vision", 15), ("vision", 15))]
    batch = collate([trainer.train_set[0], trainer.train_set[1]], pad_id=0)
    assert [tuple(s.tolist()) for s in batch.modality_inputs["vision"]["spatial_shapes"]] == [(3, 5), (4, 4),
                                                                                             (5, 3), (3, 5)]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.fit()
    assert len(result["losses"]) == 3 and all(np.isfinite(result["losses"]))
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert any(n.startswith("encoders.vision.encoder.embeddings.position_embedding") for n in moved)


def test_bad_images_are_refused_naming_record_and_file(tmp_path):
    from plait.models.registry import build_model, build_processor, load_tokenizer

    records = _two_image_records(tmp_path)
    for processor, message in [({"patch_size": 8}, "patches of 192 values, the SigLIP2 encoder expects 48")]:
        cfg = config_from_dict(_job(tmp_path, records, processor))
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        model = build_model(cfg.model, tokenizer)
        mm = build_processor(cfg.model, model, tokenizer, 256)
        with pytest.raises(SampleError, match=rf"record 'pair-0'.*img0.png.*{message}"):
            mm(sample_at(JsonlSource(cfg.data.train), 0))


def test_max_num_patches_above_the_tower_is_refused_when_the_job_is_built(tmp_path):
    """Images larger than the tower's position grid were refused record by record (the feature count still refuses
    them, test_feature_count_and_checks); a processor that allows them is now refused before any record is read."""
    from plait.models.registry import build_model, build_processor, load_tokenizer

    cfg = config_from_dict(_job(tmp_path, _two_image_records(tmp_path), {"max_num_patches": 32}))
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tokenizer)
    with pytest.raises(ValueError, match=r"model.encoders.vision.processor.max_num_patches = 32 is above the SigLIP2 "
                                         r"tower's num_patches = 16"):
        build_processor(cfg.model, model, tokenizer, 256)


def test_a_path_towers_processor_table_overrides_the_saved_processor_and_is_checked(tmp_path):
    """A tower loaded from ``path`` (a local folder written by save_pretrained) applies the job's ``processor``
    table over the folder's processor, as a ``config`` tower does (the table was ignored: the saved values won)."""
    from plait.models.registry import build_model, build_processor, load_tokenizer

    folder = tmp_path / "siglip2"
    kwargs = {k: v for k, v in TINY_SIGLIP2.items() if k != "model_type"}
    T.Siglip2VisionModel(T.Siglip2VisionConfig(**kwargs)).save_pretrained(folder)
    T.Siglip2ImageProcessorPil(patch_size=4, max_num_patches=16).save_pretrained(folder)
    records = _two_image_records(tmp_path)

    def processor(table: dict):
        job = _job(tmp_path, records, table)
        job["model"]["encoders"]["vision"] = {"modality": "image", "path": str(folder), "processor": table}
        cfg = config_from_dict(job)
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        return build_processor(cfg.model, build_model(cfg.model, tokenizer), tokenizer, 256)

    assert processor({}).specs["image"].hf_processor.max_num_patches == 16  # the folder's
    assert processor({"max_num_patches": 4}).specs["image"].hf_processor.max_num_patches == 4
    with pytest.raises(ValueError, match=r"model.encoders.vision.processor.max_num_patches = 64 is above the SigLIP2 "
                                         r"tower's num_patches = 16"):
        processor({"max_num_patches": 64})
