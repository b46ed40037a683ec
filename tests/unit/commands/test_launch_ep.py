"""``plait launch`` refuses ``parallel.ep`` above 1 as it does TP and CP: its heterogeneous pipelines of whole layers
run no expert parallelism inside them (a failure would have to re-split the experts over the survivors)."""

from __future__ import annotations

import pytest

from plait.commands.launch import check_launch
from plait.config.loader import config_from_dict
from tests.helpers.jobs import tiny_config_dict
from tests.helpers.moe import TINY_MOE_LLM


def test_check_launch_refuses_expert_parallelism():
    data = tiny_config_dict("train.jsonl", None, "runs/x", train={"steps": 4})
    data["model"]["llm"]["config"] = dict(TINY_MOE_LLM)
    check_launch(config_from_dict(data), 4)  # a MoE job without EP passes
    data["parallel"] = {"ep": 2, "dp": 2}
    with pytest.raises(ValueError, match=r"^parallel.ep = 2: plait launch plans its own pipelines .* runs no expert "
                                         r"parallelism inside them: a failure would have to re-split the experts "
                                         r"over the survivors, .*; set --parallel.ep=1"):
        check_launch(config_from_dict(data), 4)
