"""The node layout from torchrun's variables (``plait.parallel.process_group.node_layout``) and a restarted job's
resume (``plait.train.run_start.elastic_restart``), without processes."""

from __future__ import annotations

import pytest

from plait.parallel.process_group import NodeLayout, node_layout
from plait.train.run_start import elastic_restart


def _env(world, rank, per_node, nodes, node):
    return {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_WORLD_SIZE": str(nodes), "GROUP_RANK": str(node)}


def test_the_layout_of_two_nodes_and_of_one_process():
    layout = node_layout(_env(4, 2, 2, 2, 1))
    assert layout == NodeLayout(nodes=2, per_node=2, node_rank=1)
    assert layout.describe() == "2 nodes x 2 processes"
    assert node_layout({}) == NodeLayout(1, 1, 0) and node_layout({}).describe() == "1 node x 1 process"
    assert node_layout({"WORLD_SIZE": "3", "RANK": "2", "LOCAL_WORLD_SIZE": "3"}) == NodeLayout(1, 3, 0)


def test_a_layout_plait_cannot_number_is_refused_naming_the_variables():
    with pytest.raises(ValueError, match=r"WORLD_SIZE=5 is not GROUP_WORLD_SIZE=2 nodes x LOCAL_WORLD_SIZE=2 "
                                         r"processes: .*--nproc_per_node N on each"):
        node_layout(_env(5, 0, 2, 2, 0))
    with pytest.raises(ValueError, match=r"RANK=2 with LOCAL_WORLD_SIZE=2 would be on node 1, but GROUP_RANK=0"):
        node_layout(_env(4, 2, 2, 2, 0))


def test_a_restarted_job_resumes_from_its_newest_complete_checkpoint(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    for step, complete in ((2, True), (3, True), (4, False)):  # step 4 was being written when the job failed
        folder = run / "checkpoints" / f"step_{step:06d}"
        folder.mkdir(parents=True)
        if complete:
            (folder / ".metadata").write_bytes(b"x")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert elastic_restart(run, False, True) == (False, True)  # a first start: the flags as given
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("RANK", "0")
    assert elastic_restart(run, False, True) == (True, False)  # never --overwrite the run it continues
    assert f"torchrun restart 1: resuming from {run / 'checkpoints' / 'step_000003'}" in capsys.readouterr().out
    assert elastic_restart(tmp_path / "empty", False, False) == (False, False)
    assert "no complete checkpoint" in capsys.readouterr().out
