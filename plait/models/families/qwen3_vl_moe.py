"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, -235B-A22B): Qwen3-VL's tower with its DeepStack mergers
(:mod:`plait.models.families.qwen3_vl`) in front of a mixture-of-experts text model.

The tower (transformers' ``Qwen3VLMoeVisionModel``, config ``qwen3_vl_moe_vision``) is Qwen3-VL's under other class
names: the same blocks, merger, DeepStack mergers, learned position table and processor, so the family is
:class:`~plait.models.families.qwen3_vl.Qwen3VLFamily` with those names. The LLM is ``Qwen3VLMoeTextModel``
(interleaved M-RoPE, DeepStack receivers after its first ``k`` decoder layers, as Qwen3-VL's) whose MLPs are sparse
MoE blocks: a top-k router (``mlp.gate``, ``Qwen3VLMoeTextTopKRouter``) and the fused experts (``mlp.experts``:
``gate_up_proj [E, 2 I, H]``, ``down_proj [E, H, I]``), the structure plait's expert parallelism, router-load
measurement and planner read (``plait.parallel.expert_parallel``, ``plait.measure.router_load``,
``plait.planner.cost.experts``), as for Qwen3-MoE.
"""

from __future__ import annotations

from typing import Any

from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextModel

from plait.models.families.base import TextStackCausalLM, register_causal_lm
from plait.models.families.qwen3_vl import Qwen3VLFamily

__all__ = ["FAMILY", "MODEL_TYPES", "ENCODER_CLASS", "Qwen3VLMoeTextForCausalLM"]

MODEL_TYPES = {"qwen3_vl_moe_vision": None, "qwen3_vl_moe": "vision_config"}
ENCODER_CLASS = "Qwen3VLMoeVisionModel"


@register_causal_lm
class Qwen3VLMoeTextForCausalLM(TextStackCausalLM, Qwen3MoeForCausalLM):
    """Qwen3-VL-MoE's LLM as a causal LM: ``Qwen3MoeForCausalLM`` (``lm_head``, forward with the router's
    load-balancing loss when the config asks for ``output_router_logits``, generation) whose decoder stack ``model``
    is transformers' ``Qwen3VLMoeTextModel`` (interleaved M-RoPE: ``position_ids`` ``[3, B, N]``, or ``[B, N]`` for
    text; sparse MoE MLPs). State-dict names are ``model.*`` and ``lm_head.weight``, the ``language_model`` /
    ``lm_head`` tensors of ``Qwen3VLMoeForConditionalGeneration``. DeepStack features reach its decoder layers
    through forward hooks (``plait.models.deepstack``).

    Args:
        config: a ``Qwen3VLMoeTextConfig``.
    """

    config_class = Qwen3VLMoeTextConfig
    decoder_stack = Qwen3VLMoeTextModel

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts = config.num_experts
        self.num_experts_per_tok = config.num_experts_per_tok

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """True: the experts are transformers' own ``Qwen3VLMoeTextExperts``, which take every experts
        implementation (transformers decides this by reading the class's module source, here plait's)."""
        return True


class Qwen3VLMoeFamily(Qwen3VLFamily):
    """Qwen3-VL-MoE's tower: :class:`~plait.models.families.qwen3_vl.Qwen3VLFamily` (call, layout, TP plan, feature
    count, video refusal, architecture facts) under the MoE model's class and config names."""

    name = "Qwen3-VL-MoE"
    model_types = MODEL_TYPES
    encoder_class = ENCODER_CLASS
    layer_class = "Qwen3VLMoeVisionBlock"


FAMILY = Qwen3VLMoeFamily()
