"""Voxtral in and out of plait (``plait.models.hf_io_voxtral``): import then export gives back the same tensors
(bit-identical); the export saved and loaded by transformers generates the original's tokens on two clips; a trained
projector is folded into the tower's projector (same logits); a composite Voxtral cannot hold is refused naming the
difference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers as T

from plait.models.hf_io_voxtral import check_voxtral_exportable, composite_from_voxtral, voxtral_from_composite
from plait.models.multimodal import MultimodalModel
from tests.helpers.voxtral import AUDIO, WINDOW_SAMPLES, rows, tiny_voxtral


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])  # a text config asking for tied embeddings: still two tensors
def test_import_then_export_is_bit_identical_and_loads_in_transformers(tmp_path, tied):
    original = tiny_voxtral(tied=tied)
    want = _state(original)
    exported = voxtral_from_composite(composite_from_voxtral(tiny_voxtral(tied=tied)))
    got = exported.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    exported.save_pretrained(tmp_path / "hf")
    loaded = T.VoxtralForConditionalGeneration.from_pretrained(str(tmp_path / "hf")).eval()
    assert loaded.config.audio_token_id == AUDIO and loaded.config.projector_hidden_act == "gelu"
    assert not hasattr(loaded.config.audio_config, "projector_hidden_size")
    assert loaded.lm_head.weight is not loaded.model.language_model.embed_tokens.weight  # the class never ties
    r = rows([[3000, WINDOW_SAMPLES]], seed=5)
    settings = dict(max_new_tokens=6, do_sample=False, eos_token_id=[2], pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(loaded.generate(**r.hf, **settings), original.generate(**r.hf, **settings))


def test_a_trained_projector_folds_into_the_towers_projector():
    model = composite_from_voxtral(tiny_voxtral()).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        weight = model.encoders["audio"].projector.linear_1.weight
        weight.add_(torch.randn_like(weight) * 0.05)
    r = rows([[4000], [WINDOW_SAMPLES]], seed=2)
    with torch.no_grad():
        want = model(r.input_ids, r.modality_inputs, r.attention_mask)
        got = voxtral_from_composite(model).eval()(**r.hf).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_composite_voxtral_cannot_hold_is_refused(tmp_path):
    model = composite_from_voxtral(tiny_voxtral())
    with torch.no_grad():
        model.encoders["audio"].projector.linear_1.bias.fill_(0.1)
    with pytest.raises(ValueError, match="non-zero bias: train with freeze_projector = true"):
        check_voxtral_exportable(model)
    del model.encoders["audio"]
    with pytest.raises(ValueError, match="one Voxtral audio tower"):
        check_voxtral_exportable(model)
    with pytest.raises(ValueError, match="reads a VoxtralForConditionalGeneration"):
        composite_from_voxtral(T.LlamaForCausalLM(T.LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                                num_attention_heads=2, intermediate_size=32)))


def test_plaits_save_then_export_is_bit_identical(tmp_path):
    original = tiny_voxtral(seed=3)
    composite_from_voxtral(tiny_voxtral(seed=3)).save_pretrained(tmp_path / "plait")
    back = MultimodalModel.from_pretrained(tmp_path / "plait")
    got, want = voxtral_from_composite(back).state_dict(), original.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_plait_import_then_export_of_a_voxtral_folder(tmp_path):
    """``plait import`` writes the branch (placeholder ``[AUDIO]``, identity projector frozen) and a job; ``plait
    export --format voxtral`` gives every tensor back bit-identically, transformers loads the folder (model and
    ``VoxtralProcessor``) and generates plait's greedy tokens for a prompt with two clips."""
    import numpy as np
    from safetensors.torch import load_file

    from plait.commands.export_hf import export_checkpoint
    from plait.commands.import_hf import import_checkpoint
    from plait.config.loader import load_config
    from plait.models.generation import greedy_token_ids
    from tests.helpers.voxtral import save_voxtral

    src = save_voxtral(tmp_path / "src")
    model_dir, job = import_checkpoint(src, tmp_path / "imported")
    cfg = load_config(job)
    assert cfg.model.encoders["audio"].freeze and cfg.model.encoders["audio"].freeze_projector
    out = export_checkpoint(model_dir, "voxtral", tmp_path / "exported")
    left, right = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(left) == sorted(right) and all(torch.equal(left[k], right[k]) for k in left)
    processor = T.AutoProcessor.from_pretrained(str(out))
    assert type(processor).__name__ == "VoxtralProcessor"
    hf = T.VoxtralForConditionalGeneration.from_pretrained(str(out)).eval()
    plait_model = MultimodalModel.from_pretrained(model_dir).eval()
    audio = hf.config.audio_token_id
    clips = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i, n in enumerate([48000, 7000])]
    feats = processor.feature_extractor(clips, sampling_rate=16000, return_tensors="pt")["input_features"]
    ids = torch.tensor([[1, 40, 41] + [audio] * 75 + [42] + [audio] * 75 + [43, 44]])
    batch = SimpleNamespace(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=None,
                            rope_position_ids=None, item_ids=torch.full_like(ids, -1),
                            modality_inputs={"audio": {"input_features": feats,
                                                       "num_samples": torch.tensor([48000, 7000])}})
    with torch.no_grad():
        mine = greedy_token_ids(plait_model, batch, [2], 6, 0)[0].tolist()
        theirs = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=feats,
                             max_new_tokens=6, do_sample=False, eos_token_id=[2], pad_token_id=0)
    assert theirs[0, ids.shape[1]:].tolist() == mine and len(mine) >= 1


def test_the_voxtral_import_uses_only_public_names_of_hf_io():
    """The Voxtral import assembles its LLM with ``hf_io``'s public ``assemble_causal_lm`` (the one the LLaVA-style
    import uses), not a private helper of another module."""
    import ast
    import inspect

    import plait.models.hf_io as hf_io
    import plait.models.hf_io_voxtral as voxtral

    imported = [(node.module, alias.name) for node in ast.walk(ast.parse(inspect.getsource(voxtral)))
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plait")
                for alias in node.names]
    assert ("plait.models.hf_io", "assemble_causal_lm") in imported
    assert not [name for _, name in imported if name.startswith("_")]
    assert "assemble_causal_lm" in hf_io.__all__
