"""Tensor-parallel plans matched to a live composite (no process group): the composite's plan covers the LLM,
both encoders and the MLP projector; tied embeddings stay replicated; styles plait does not apply, adapted
embeddings and degrees that split heads are refused with the module's name; the squared-norm shares add up."""

from __future__ import annotations

import pytest
import torch

from plait.config.loader import config_from_dict
from plait.data.chat_template import tokenizer_dir
from plait.models.registry import build_model, load_tokenizer
from plait.parallel.tensor_parallel import apply_tensor_parallel, concrete_plan, grad_square_sum, model_tp_plan
from tests.helpers.jobs import tiny_config_dict


def _model(tie: bool = False):
    cfg = tiny_config_dict("unused.jsonl")
    cfg["model"]["llm"]["config"]["tie_word_embeddings"] = tie
    job = config_from_dict(cfg)
    tokenizer = load_tokenizer(tokenizer_dir(job.data, job.model), job.data.chat_template)
    return build_model(job.model, tokenizer, device="meta", seed=0)


def test_composite_plan_covers_llm_encoders_and_mlp_projector():
    plan = concrete_plan(model := _model(), model_tp_plan(model))
    assert plan["language_model.model.layers.1.mlp.down_proj"] == "rowwise"
    assert plan["language_model.lm_head"] == "colwise_gather_output"
    assert plan["language_model.model.embed_tokens"] == "embedding_rowwise"
    assert plan["encoders.vision.encoder.encoder.layers.0.self_attn.q_proj"] == "colwise"
    assert plan["encoders.audio.encoder.layers.1.fc2"] == "rowwise"
    assert plan["encoders.vision.projector.linear_1"] == "colwise"
    assert not any(k.startswith("encoders.audio.projector") for k in plan)  # a linear projector stays replicated
    assert len(plan) == 2 * 7 + 2 + 2 * 6 + 2 * 6 + 2


def test_tied_embeddings_stay_replicated():
    plan = model_tp_plan(_model(tie=True))
    assert "language_model.lm_head" not in plan and "language_model.model.embed_tokens" not in plan


def test_unknown_style_is_refused_naming_the_module():
    model = _model()
    with pytest.raises(ValueError, match=r"language_model.model.layers.0.mlp.up_proj has style 'packed_colwise'"):
        concrete_plan(model, {"language_model.model.layers.*.mlp.up_proj": "packed_colwise"})


class _Mesh:
    ndim = 1

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_degree_that_splits_heads_is_refused():
    with pytest.raises(ValueError, match=r"parallel.tp=4 does not divide the 2 heads of language_model.model"):
        apply_tensor_parallel(_model(), _Mesh(4))  # 4 query heads but 2 key/value heads


def test_square_sum_shares_add_up_to_the_norm():
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 2.0]])]
    total = grad_square_sum(grads, copies=1)
    assert total.dtype == torch.float64 and float(total) == 30.0
    assert float(grad_square_sum(grads, copies=4)) * 4 == 30.0  # four ranks hold every plain gradient
    with pytest.raises(ValueError, match="copies must be >= 1"):
        grad_square_sum(grads, copies=0)
