"""``parallel.offload`` (FSDP2 CPU offload): accepted with FSDP2 wrapping and no pipeline stages, refused otherwise
with a message naming the field and what it needs."""

from __future__ import annotations

import pytest

from plait.config.loader import config_from_dict, validate
from tests.conftest import tiny_config_dict


def _cfg(**parallel):
    cfg = config_from_dict(tiny_config_dict("train.jsonl", parallel=parallel))
    validate(cfg)
    return cfg


def test_offload_needs_fsdp2_and_no_pipeline_stages():
    assert _cfg().parallel.offload == "none"
    assert _cfg(dp_shard=2, offload="cpu").parallel.offload == "cpu"
    with pytest.raises(ValueError, match="parallel.offload must be 'none' or 'cpu', got 'gpu'"):
        _cfg(dp_shard=2, offload="gpu")
    with pytest.raises(ValueError, match=r"needs parallel.dp_shard > 1 \(FSDP2 wrapping\), got dp_shard = 1"):
        _cfg(offload="cpu")
    with pytest.raises(ValueError, match="needs parallel.pp.degree = 1.*got pp.degree = 2"):
        _cfg(dp_shard=2, offload="cpu", pp={"degree": 2})
