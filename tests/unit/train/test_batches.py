"""The encoder view of a deferring step takes its samples' media items from the LLM view's batches (each sample
collated once): equal to stacking the encoder microbatch's samples directly."""

from __future__ import annotations

import torch

from plait.planner.microbatch.routing import FeatureRouting
from plait.train.batches import encoder_view_batch
from tests.distributed.pipeline_deferral_worker import FEATURES, make_sample, stack

MEDIA = ("iI", "a", "ia", "")  # per sample key: two images, a clip, an image and a clip, text only


def test_encoder_view_equals_the_samples_stacked_in_encoder_order():
    samples = [make_sample(media, 3, k) for k, media in enumerate(MEDIA)]
    features = {k: {"vision": sum(FEATURES[c] for c in m if c in "iI"), "audio": 7 * m.count("a")}
                for k, m in enumerate(MEDIA)}
    # samples 1 and 2 are deferred from encoder microbatch 0 to LLM microbatch 1
    routing = FeatureRouting(((0, 1, 2), (3,)), ((0,), (1, 2, 3)), features)
    llm = [stack([samples[k] for k in keys]) for keys in routing.llm_samples]
    items = {k: {"vision": sum(c in "iI" for c in m), "audio": m.count("a")} for k, m in enumerate(MEDIA)}
    got = encoder_view_batch(0, routing, llm, items)
    want = stack([samples[k] for k in routing.encoder_samples[0]]).modality_inputs
    assert sorted(got.modality_inputs) == ["audio", "vision"]
    assert [p.shape for p in got.modality_inputs["vision"]["pixel_values"]] == [(3, 16, 16), (3, 24, 32), (3, 16, 16)]
    for a, b in zip(got.modality_inputs["vision"]["pixel_values"], want["vision"]["pixel_values"]):
        assert torch.equal(a, b)
    assert torch.equal(got.modality_inputs["audio"]["input_features"], want["audio"]["input_features"])
    assert got.modality_inputs["audio"]["num_samples"].tolist() == [8000, 8000]
    assert got.input_ids.shape == (3, 0)
    assert encoder_view_batch(1, routing, llm, items).modality_inputs == {}
