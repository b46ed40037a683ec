"""``plait train`` with ``[parallel.pp] virtual_stages = 2, attach_encoders = true`` (interleaved 1F1B) on 2 gloo
processes under torchrun equals the single-process ``Trainer`` on the same job: the first global batch's loss and
gradients, both steps' losses and the final parameters, within fp32 tolerance (``assert_same_training``: losses rel
1e-5; gradients rtol 1e-5 + atol 1e-5 x the tensor's largest entry; parameters rtol 1e-5, atol 1e-6). The LLM is cut
into 4 stages on the 2 ranks (LLM stage j on rank j mod 2) with both encoders on rank 0, which the measured timeline
confirms; the hierarchical microbatch plan defers some samples' LLM work, so the attached encoders' outputs are
also buffered across microbatches. Worker: ``pipeline_deferral_worker.trainer_main``."""

from __future__ import annotations

from plait.train.plots import read_chrome_trace
from tests.helpers.jobs import tiny_config_dict, write_jsonl
from tests.helpers.pipeline_deferral import deferral_train
from tests.helpers.deferral import assert_same_training, deferral_records


def test_interleaved_job_on_two_processes_trains_like_one_process(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", deferral_records())
    cfg = tiny_config_dict(str(data), None, str(tmp_path / "run"), data={"shuffle": False},
                           train={"steps": 2, "global_batch_size": 8, "microbatch_size": 2, "threads": 1},
                           parallel={"timeout_s": 60})
    single = deferral_train(cfg, tmp_path, "single", 1)
    cfg["parallel"]["pp"] = {"degree": 2, "virtual_stages": 2, "attach_encoders": True, "schedule": "interleaved_1f1b"}
    pp = deferral_train(cfg, tmp_path, "pp", 2)
    assert any(n.startswith("encoders.audio.encoder") for n in single["grads"])  # encoders and LLM train
    assert_same_training(single, pp)
    assert pp["deferred"] == single["deferred"] and pp["deferred"]  # same plan, with deferred samples

    events = read_chrome_trace(tmp_path / "run_pp" / "timeline.json")["measured"]
    ranks = {e.stage: e.rank for e in events}
    assert ranks == {0: 0, 1: 0, 2: 0, 3: 1, 4: 0, 5: 1}  # vision, audio, LLM stages 0..3
    assert {e.microbatch for e in events} == {0, 1, 2, 3}
