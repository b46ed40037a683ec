"""Context parallelism in the trainer: CP=2 and CP=4 (gloo) equal one process, for multimodal
(bidirectional item) masks and packed documents, with uneven token counts per rank (small blocks)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl
from tests.helpers.data_parallel import assert_same_training, run

CASES = {
    "cp2-bidirectional-padded": (2, "bidirectional_items", False),
    "cp2-causal-packed": (2, "causal", True),
    "cp4-bidirectional-packed": (4, "bidirectional_items", True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cp_equals_single_process(tmp_path, case):
    cp, mask, packing = CASES[case]
    records = (demo_records("train", ("image_audio",), limit=2) + demo_records("train", ("image_digit",), limit=1)
               + demo_records("train", ("text",), limit=1))
    data = write_jsonl(tmp_path / "train.jsonl", records)
    cfg = tiny_config_dict(str(data), None, str(tmp_path / "run"),
                           data={"shuffle": False, "packing": packing},
                           train={"steps": 2, "global_batch_size": 4, "microbatch_size": 2, "threads": 1},
                           attention={"mask": mask, "block_size": 16},
                           parallel={"timeout_s": 60})
    single = run(cfg, tmp_path, "single", 1)
    cfg["parallel"]["cp"] = cp
    cfg["metrics"]["run_dir"] = str(tmp_path / "run_cp")
    multi = run(cfg, tmp_path, "cp", cp)
    assert multi["world"] == cp
    torch.testing.assert_close(torch.tensor(multi["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    assert_same_training(single, multi)
