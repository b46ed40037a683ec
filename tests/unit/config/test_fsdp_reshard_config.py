"""``parallel.fsdp_reshard`` (when FSDP2 without pipeline stages frees its gathered parameters): ``"auto"`` by
default, ``"after_forward"`` / ``"after_backward"`` accepted with FSDP2 and no pipeline stages, refused otherwise with
a message naming the field."""

from __future__ import annotations

import pytest

from plait.config.loader import config_from_dict, validate
from tests.conftest import tiny_config_dict


def _cfg(**parallel):
    cfg = config_from_dict(tiny_config_dict("train.jsonl", parallel=parallel))
    validate(cfg)
    return cfg


def test_fsdp_reshard_explicit_needs_fsdp2_and_no_pipeline_stages():
    assert _cfg().parallel.fsdp_reshard == "auto"
    assert _cfg(dp_shard=2, pp={"degree": 3}).parallel.fsdp_reshard == "auto"  # auto: fine anywhere
    for value in ("after_forward", "after_backward"):
        assert _cfg(dp_shard=2, fsdp_reshard=value).parallel.fsdp_reshard == value
    with pytest.raises(ValueError, match="parallel.fsdp_reshard must be 'auto', 'after_forward' or 'after_backward', "
                                         "got 'never'"):
        _cfg(dp_shard=2, fsdp_reshard="never")
    with pytest.raises(ValueError, match="fsdp_reshard = 'after_backward' .*needs parallel.dp_shard > 1, got "
                                         "dp_shard = 1"):
        _cfg(fsdp_reshard="after_backward")
    with pytest.raises(ValueError, match="fsdp_reshard = 'after_forward' needs parallel.pp.degree = 1.*got "
                                         "pp.degree = 3"):
        _cfg(dp_shard=2, fsdp_reshard="after_forward", pp={"degree": 3})
