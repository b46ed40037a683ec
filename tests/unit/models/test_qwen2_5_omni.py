"""The Qwen2.5-Omni thinker as a plait composite (``plait.models.families.qwen2_5_omni``,
``plait.data.omni_positions``, ``plait.models.hf_io_omni``): the composite built from a tiny
``Qwen2_5OmniThinkerForConditionalGeneration`` gives the HF model's logits (fp32, 1e-5) with plait's own M-RoPE
positions on an image, an audio clip, a video with its audio track (``use_audio_in_video``: chunks interleaved,
time-aligned positions) beside an image and an audio clip, and silent videos in a padded batch; the positions are
transformers' ``get_rope_index``'s; greedy decoding gives ``generate``'s tokens; bad layouts are refused naming the
item."""

from __future__ import annotations

import pytest
import torch

from plait.data.collate import Batch
from plait.data.omni_positions import OmniItem, clip_chunks, omni_positions
from plait.models.families import family_of
from plait.models.families.qwen2_5_omni import Qwen25OmniTextForCausalLM
from plait.models.generation import greedy_token_ids
from plait.models.hf_io_omni import composite_from_thinker
from tests.helpers.qwen2_5_omni import HOP, rows, tiny_thinker

LAYOUTS = {
    "image": [[("image", (1, 4, 6))]],
    "audio": [[("audio", 16000)]],
    "clip": [[("image", (1, 4, 4)), ("audio", 8000), ("clip", ((4, 4, 4), 48000))]],
    "videos": [[("video", (4, 4, 4)), ("image", (1, 4, 4))], [("image", (1, 4, 6)), ("audio", 5000)]],
    "images": [[("image", (1, 4, 4)), ("image", (1, 6, 4)), ("audio", 7000), ("image", (1, 4, 6))]],
}


def _hf_positions(hf, r) -> torch.Tensor:
    feats = r.hf.get("feature_attention_mask")
    return hf.model.get_rope_index(r.input_ids, r.hf.get("image_grid_thw"), r.hf.get("video_grid_thw"),
                                   r.attention_mask, r.hf["use_audio_in_video"],
                                   None if feats is None else feats.sum(-1), r.hf.get("video_second_per_grid"))[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_equal_hf_with_plaits_positions(layout):
    hf = tiny_thinker()
    model = composite_from_thinker(tiny_thinker()).eval()
    assert isinstance(model.language_model, Qwen25OmniTextForCausalLM)
    r = rows(LAYOUTS[layout])
    real = r.attention_mask.bool()
    if "image_grid_thw" in r.hf or "video_grid_thw" in r.hf:
        assert torch.equal(r.rope[:, real], _hf_positions(hf, r)[:, real])
    with torch.no_grad():
        want = hf(**r.hf).logits
        mine = model(r.plait_ids, r.modality_inputs, r.attention_mask, r.positions, rope_position_ids=r.rope)
        flat = model(r.plait_ids, r.modality_inputs, r.attention_mask, r.positions)
    torch.testing.assert_close(mine[real], want[real], rtol=1e-5, atol=1e-5)
    if layout in ("clip", "videos"):  # 1-D positions answer otherwise: the M-RoPE positions matter
        assert (flat - want)[real].abs().max() > 1e-3


def test_clip_audio_and_video_share_temporal_positions():
    """A 4-s clip sampled at 1 s per temporal patch with 3 s of audio: video chunk, audio chunk, video, audio; the
    video's patch at second 2 and the audio at second 2 have the same temporal position (start + 50)."""
    r = rows([[("clip", ((4, 4, 4), 48000))]])
    ids, items, rope = r.item_ids[0], r.item_ids[0], r.rope[:, 0]
    assert clip_chunks((4, 4, 4), 2, 1.0, 75, 25.0, 2.0) == [("video", 8), ("audio", 50), ("video", 8), ("audio", 25)]
    start = int(rope[0, ids == 0].min())
    video_t = rope[0, items == 0] - start
    audio_t = rope[0, items == 1] - start
    assert sorted(set(video_t.tolist())) == [0, 25, 50, 75]
    assert audio_t.tolist() == list(range(75))
    assert int(rope[0, torch.nonzero(items == 1)[50]]) - start == 50  # the third second's first audio feature


def test_greedy_tokens_equal_hf_generate():
    """Each clip's audio covers its video (as a clip's own track does), so the text after it continues from its
    largest position, transformers' rule for the first decoded token."""
    r = rows([[("clip", ((4, 4, 4), 64000))], [("image", (1, 4, 4)), ("audio", 9000), ("clip", ((2, 4, 4), 32000))]],
             seed=3, left=True)
    hf, model = tiny_thinker(), composite_from_thinker(tiny_thinker()).eval()
    empty = {f: None for f in Batch.__dataclass_fields__}
    batch = Batch(**(empty | dict(input_ids=r.plait_ids, attention_mask=r.attention_mask, position_ids=r.positions,
                                  rope_position_ids=r.rope, item_ids=r.item_ids,
                                  modality_inputs=r.modality_inputs)))
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=[2], pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(**r.hf, **settings)[:, r.input_ids.shape[1]:]
    mine = greedy_token_ids(model, batch, [2], 8, 0)
    assert mine.tolist() == want.tolist() and mine.shape[1] >= 2


def test_audio_feature_count_is_the_towers():
    """Qwen2-Audio's count over the window equals the Omni tower's output per clip (``_get_feat_extract_output_lengths``
    of ``ceil(n / hop)`` frames), and the branch cuts the packed output per clip."""
    model = composite_from_thinker(tiny_thinker()).eval()
    branch = model.encoders["audio"]
    assert family_of("qwen2_5_omni_audio_encoder").name == "Qwen2.5-Omni audio"
    samples = [1000, 16000, 23999, 48000]
    frames = torch.tensor([-(-n // HOP) for n in samples])
    want = branch.encoder._get_feat_extract_output_lengths(frames)[1].tolist()
    assert [branch.feature_count(n) for n in samples] == want
    feats = torch.randn(len(samples), 16, 3000)
    with torch.no_grad():
        out = branch.encoder_forward({"input_features": feats, "num_samples": torch.tensor(samples)})
    assert out.shape == (sum(want), 48)
    with pytest.raises(ValueError, match="downsample = 1"):
        branch.family.feature_count(branch.encoder, "full", 2)


def test_bad_layouts_are_refused_naming_the_item():
    video = OmniItem("video", (4, 4, 4), 1.0, 25.0, clip=1)
    items = [video, OmniItem("audio")]
    ids = torch.zeros(2 + 16 + 75 + 4, dtype=torch.long)
    swapped = torch.tensor([-1, -1] + [1] * 50 + [0] * 8 + [1] * 25 + [0] * 8 + [-1] * 4)  # audio before video
    with pytest.raises(ValueError, match=r"item 0: the clip's video and audio tokens run"):
        omni_positions(ids, swapped, items)
    tight = torch.tensor([-1] + [0] * 8 + [1] * 50 + [0] * 8 + [1] * 25 + [-1] * 5)  # one token before a clip
    with pytest.raises(ValueError, match=r"item 0 \(video\) needs 2 text token"):
        omni_positions(ids, tight, items)
    silent = [OmniItem("video", (2, 4, 4), 1.0), OmniItem("video", (4, 4, 4), 1.0, 25.0, clip=2), OmniItem("audio")]
    mixed = torch.tensor([-1] + [0] * 8 + [-1] * 3 + [1] * 8 + [2] * 50 + [1] * 8 + [2] * 25 + [-1] * 2)
    with pytest.raises(ValueError, match="item 0: a video without its audio track"):
        omni_positions(torch.zeros(len(mixed)), mixed, silent)


def test_planner_facts_count_the_audio_tower_but_its_projection():
    from plait.planner.cost.arch import EncoderArch, model_param_count

    tower = composite_from_thinker(tiny_thinker()).encoders["audio"].encoder
    family = family_of(tower.config.model_type)
    arch = EncoderArch(**family.arch_fields(tower.config))
    uncosted = tower.proj.weight.numel() + tower.proj.bias.numel() + tower.audio_bos_eos_token.weight.numel()
    assert model_param_count(arch) == sum(p.numel() for p in tower.parameters()) - uncosted


@pytest.mark.parametrize("layout", ["image", "audio", "videos", "images"])
def test_the_thinkers_positions_are_qwen2_5_vls_but_after_a_video(layout):
    """Images and audio clips are positioned alike by the thinker's ``get_rope_index`` and Qwen2.5-VL's
    (:func:`plait.data.mrope.mrope_positions`); after a video the thinker's text continues past the video's largest
    temporal position, Qwen2.5-VL's from its spatial extent, so the collator positions a document with a thinker's
    video by the thinker's rule."""
    from plait.data.mrope import mrope_positions

    r = rows(LAYOUTS[layout])
    for b, items in enumerate(r.docs):
        real = r.attention_mask[b] == 1
        grids = [it.grid for it in items]
        timing = [(it.second_per_grid_t, it.position_id_per_seconds) if it.kind == "video" else None for it in items]
        want = mrope_positions(r.plait_ids[b][real], r.item_ids[b][real], grids, timing)
        same = torch.equal(r.rope[:, b, real], want)
        assert same == (not any(it.kind == "video" for it in items))


def test_lora_defaults_of_the_thinkers_parts():
    """The text model takes the decoder's projections, the audio tower Whisper's layer projections (not its proj)."""
    from plait.models.lora import DEFAULT_TARGETS, lora_targets

    model = composite_from_thinker(tiny_thinker())
    audio = lora_targets(model.encoders["audio"].encoder, DEFAULT_TARGETS["qwen2_5_omni_audio_encoder"])
    assert len(audio) == 2 * 6 and "proj" not in audio
    llm = lora_targets(model.language_model, DEFAULT_TARGETS["qwen2_5_omni_text"])
    assert len(llm) == 2 * 7
