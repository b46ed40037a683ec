"""FSDP2 settings for jobs without pipeline stages: ``parallel.offload`` (CPU offload), ``parallel.fsdp_reduce`` (when
gradients are reduce-scattered) and ``parallel.fsdp_reshard`` (when gathered parameters are freed). Each has a
default accepted anywhere; its other values are accepted with FSDP2 wrapping and no pipeline stages, refused otherwise
with a message naming the field and what it needs."""

from __future__ import annotations

import pytest

from plait.config.loader import config_from_dict, validate
from tests.helpers.jobs import tiny_config_dict


def _cfg(**parallel):
    cfg = config_from_dict(tiny_config_dict("train.jsonl", parallel=parallel))
    validate(cfg)
    return cfg


@pytest.mark.parametrize("field, default, values, bad, bad_message, dp_message, pp, pp_message", [
    pytest.param("offload", "none", ("cpu",), "gpu", "parallel.offload must be 'none' or 'cpu', got 'gpu'",
                 r"needs parallel.dp_shard > 1 \(FSDP2 wrapping\), got dp_shard = 1",
                 2, "needs parallel.pp.degree = 1.*got pp.degree = 2", id="offload"),
    pytest.param("fsdp_reduce", "step", ("microbatch",), "layer",
                 "parallel.fsdp_reduce must be 'step' or 'microbatch', got 'layer'",
                 "needs parallel.dp_shard > 1, got dp_shard = 1",
                 2, "fsdp_reduce = 'microbatch' needs parallel.pp.degree = 1.*got pp.degree = 2", id="fsdp_reduce"),
    pytest.param("fsdp_reshard", "auto", ("after_forward", "after_backward"), "never",
                 "parallel.fsdp_reshard must be 'auto', 'after_forward' or 'after_backward', got 'never'",
                 "fsdp_reshard = 'after_backward' .*needs parallel.dp_shard > 1, got dp_shard = 1",
                 3, "fsdp_reshard = 'after_forward' needs parallel.pp.degree = 1.*got pp.degree = 3", id="fsdp_reshard"),
])
def test_fsdp_option_needs_fsdp2_and_no_pipeline_stages(field, default, values, bad, bad_message, dp_message, pp,
                                                         pp_message):
    assert getattr(_cfg().parallel, field) == default
    assert getattr(_cfg(dp_shard=2, pp={"degree": 3}).parallel, field) == default  # the default: fine anywhere
    for value in values:
        assert getattr(_cfg(dp_shard=2, **{field: value}).parallel, field) == value
    with pytest.raises(ValueError, match=bad_message):
        _cfg(dp_shard=2, **{field: bad})
    with pytest.raises(ValueError, match=dp_message):
        _cfg(**{field: values[-1]})
    with pytest.raises(ValueError, match=pp_message):
        _cfg(dp_shard=2, pp={"degree": pp}, **{field: values[0]})
