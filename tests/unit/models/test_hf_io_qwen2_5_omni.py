"""The Qwen2.5-Omni thinker in and out of plait (``plait.models.hf_io_omni``): import then export gives back the same
tensors (bit-identical); the export saved and loaded by transformers generates the original's tokens on a video with
its audio track; a trained projector is folded into its tower (same logits); plait's own save/load keeps the two
branches; a composite the thinker cannot hold is refused naming the difference."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from plait.models.hf_io_omni import (check_thinker_exportable, composite_from_thinker, load_thinker,
                                     thinker_from_composite)
from plait.models.multimodal import MultimodalModel
from tests.helpers.qwen2_5_omni import AEND, ASTART, VEND, VIDEO, VSTART, rows, tiny_thinker

EXTRA = dict(video_token_index=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
             audio_start_token_id=ASTART, audio_end_token_id=AEND)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_import_then_export_is_bit_identical_and_loads_in_transformers(tmp_path, tied):
    original = tiny_thinker(tied=tied)
    want = _state(original)
    exported = thinker_from_composite(composite_from_thinker(tiny_thinker(tied=tied)))  # the thinker's ids kept
    got = exported.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    exported.save_pretrained(tmp_path / "hf")
    loaded = load_thinker(tmp_path / "hf")
    assert type(loaded).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    assert (loaded.lm_head.weight is loaded.model.language_model.embed_tokens.weight) == tied
    assert loaded.config.position_id_per_seconds == 25 and loaded.config.vision_start_token_id == VSTART
    r = rows([[("image", (1, 4, 4)), ("clip", ((4, 4, 4), 64000))]], seed=5)
    settings = dict(max_new_tokens=6, do_sample=False, eos_token_id=[2], pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(loaded.generate(**r.hf, **settings), original.generate(**r.hf, **settings))


def test_a_trained_projector_folds_into_its_tower():
    model = composite_from_thinker(tiny_thinker()).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for branch in model.encoders.values():
            for p in branch.projector.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    r = rows([[("audio", 12000), ("clip", ((2, 4, 4), 32000))]], seed=2)
    with torch.no_grad():
        want = model(r.plait_ids, r.modality_inputs, r.attention_mask, r.positions, rope_position_ids=r.rope)
        hf = thinker_from_composite(model, EXTRA).eval()
        got = hf(**r.hf).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_plaits_own_save_and_load_keep_both_branches(tmp_path):
    model = composite_from_thinker(tiny_thinker()).eval()
    model.save_pretrained(tmp_path / "plait")
    back = MultimodalModel.from_pretrained(tmp_path / "plait").eval()
    assert back.placeholder_ids == model.placeholder_ids
    r = rows([[("clip", ((2, 4, 4), 32000))]], seed=7)
    with torch.no_grad():
        a = model(r.plait_ids, r.modality_inputs, r.attention_mask, r.positions, rope_position_ids=r.rope)
        b = back(r.plait_ids, r.modality_inputs, r.attention_mask, r.positions, rope_position_ids=r.rope)
    assert torch.equal(a, b)


def test_a_composite_the_thinker_cannot_hold_is_refused():
    model = composite_from_thinker(tiny_thinker())
    del model.encoders["audio"]
    with pytest.raises(ValueError, match="one qwen2_5_omni_vision_encoder and one qwen2_5_omni_audio_encoder tower"):
        check_thinker_exportable(model)
    with pytest.raises(ValueError, match="not an Omni thinker"):
        cfg = T.Qwen2Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32)
        import tempfile
        with tempfile.TemporaryDirectory() as folder:
            cfg.save_pretrained(folder)
            load_thinker(folder)


def test_plait_import_then_export_of_a_thinker_folder(tmp_path):
    """``plait import`` of a thinker folder writes both branches, their processors and a job; ``plait export
    --format qwen2_5_omni`` gives every tensor back bit-identically with a processor folder transformers reads."""
    from safetensors.torch import load_file

    from plait.commands.export_hf import export_checkpoint
    from plait.commands.import_hf import import_checkpoint
    from plait.config.loader import load_config
    from tests.helpers.qwen2_5_omni import save_thinker

    src = save_thinker(tmp_path / "src")
    model_dir, job = import_checkpoint(src, tmp_path / "imported")
    assert (model_dir / "processors" / "vision").is_dir() and (model_dir / "processors" / "audio").is_dir()
    cfg = load_config(job)
    assert cfg.model.encoders["vision"].video.placeholder == "<|VIDEO|>" and cfg.model.encoders["audio"].freeze
    out = export_checkpoint(model_dir, "qwen2_5_omni", tmp_path / "exported")
    left, right = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(left) == sorted(right) and all(torch.equal(left[k], right[k]) for k in left)
    back = load_thinker(out)
    for field in ("image_token_id", "video_token_id", "audio_token_id", "vision_start_token_id",
                  "audio_start_token_id", "position_id_per_seconds", "seconds_per_chunk"):
        assert getattr(back.config, field) == getattr(load_thinker(src).config, field), field
    assert T.AutoImageProcessor.from_pretrained(str(out)).patch_size == 4
    assert T.AutoFeatureExtractor.from_pretrained(str(out)).feature_size == 16
    assert "<|im_start|>" in (out / "chat_template.jinja").read_text()


def test_a_full_omni_checkpoint_gives_its_thinker(tmp_path):
    """A ``Qwen2_5OmniForConditionalGeneration`` folder (here without its talker) is read as its thinker: the
    ``thinker.*`` tensors and the thinker config."""
    from tests.helpers.qwen2_5_omni import thinker_config

    thinker = tiny_thinker(seed=2)
    full = T.Qwen2_5OmniForConditionalGeneration(T.Qwen2_5OmniConfig(thinker_config=thinker_config().to_dict(),
                                                                      enable_audio_output=False))
    full.thinker.load_state_dict(thinker.state_dict())
    full.save_pretrained(tmp_path / "omni")
    loaded = load_thinker(tmp_path / "omni")
    want = thinker.state_dict()
    assert sorted(loaded.state_dict()) == sorted(want)
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    assert loaded.config.vision_start_token_id == VSTART and loaded.config.audio_start_token_id == ASTART
