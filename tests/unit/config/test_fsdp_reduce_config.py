"""``parallel.fsdp_reduce`` (when FSDP2 without pipeline stages reduce-scatters gradients): ``"step"`` by default,
``"microbatch"`` accepted with FSDP2 and no pipeline stages, refused otherwise with a message naming the field."""

from __future__ import annotations

import pytest

from plait.config.loader import config_from_dict, validate
from tests.conftest import tiny_config_dict


def _cfg(**parallel):
    cfg = config_from_dict(tiny_config_dict("train.jsonl", parallel=parallel))
    validate(cfg)
    return cfg


def test_fsdp_reduce_microbatch_needs_fsdp2_and_no_pipeline_stages():
    assert _cfg().parallel.fsdp_reduce == "step"
    assert _cfg(dp_shard=2, fsdp_reduce="microbatch").parallel.fsdp_reduce == "microbatch"
    with pytest.raises(ValueError, match="parallel.fsdp_reduce must be 'step' or 'microbatch', got 'layer'"):
        _cfg(dp_shard=2, fsdp_reduce="layer")
    with pytest.raises(ValueError, match="needs parallel.dp_shard > 1, got dp_shard = 1"):
        _cfg(fsdp_reduce="microbatch")
    with pytest.raises(ValueError, match="fsdp_reduce = 'microbatch' needs parallel.pp.degree = 1.*got pp.degree = 2"):
        _cfg(dp_shard=2, fsdp_reduce="microbatch", pp={"degree": 2})
