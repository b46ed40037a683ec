"""The profile command's store: hit and miss on every key field, unreadable and foreign files, reuse only of a
matching profile (``plait.measure.job_profile``)."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

from plait.measure.job_profile import ProfileStore, load_or_measure
from plait.planner.cost.measured_profile import profile_mismatch
from plait.planner.cost.types import ProfileKey
from tests.unit.profile_cases import KEY
from tests.unit.profile_cases import make_profile as _profile

# ----- store ------------------------------------------------------------------------------------------------
def test_store_hit_round_trips_the_profile(tmp_path):
    store = ProfileStore(tmp_path)
    profile = _profile()
    path = store.save(profile)
    loaded, reason = store.load(ProfileKey.from_dict(json.loads(json.dumps(KEY.to_dict()))))
    assert reason == "hit" and path == store.path_for(KEY)
    assert loaded == profile and loaded.costs == profile.costs


@pytest.mark.parametrize("field, value, where", [
    ("model", {"llm": {"hidden_size": 64}, "freeze": False}, "model.llm.hidden_size"),
    ("model", {"llm": {"hidden_size": 32}, "freeze": True}, "model.freeze"),
    ("shapes", [{"input_ids": [2, 10]}], "shapes[0].input_ids[1]"),
    ("dtype", "bfloat16", "dtype"),
    ("device", "NVIDIA H200", "device"),
    ("plait_version", "0.2.0", "plait_version"),
    ("torch_version", "2.14.0", "torch_version"),
    ("clock", "thread", "clock"),
])
def test_store_misses_on_every_changed_key_field(tmp_path, field, value, where):
    store = ProfileStore(tmp_path)
    target = tmp_path / "profile.json"
    store.save(_profile(), target)  # an explicit file: the key is still checked field by field
    wanted = dataclasses.replace(KEY, **{field: value})
    loaded, reason = store.load(wanted, target)
    assert loaded is None and "stale" in reason and f"{where} differs" in reason
    assert profile_mismatch(KEY, wanted).startswith(f"{where} differs")
    assert store.load(wanted)[1].startswith("no stored profile")  # its own file name differs too


def test_store_rejects_unreadable_files(tmp_path):
    target = tmp_path / "bad.json"
    target.write_text(json.dumps({"format": 99}))
    loaded, reason = ProfileStore(tmp_path).load(KEY, target)
    assert loaded is None and "unreadable" in reason


def test_load_or_measure_reuses_only_a_matching_profile(tmp_path):
    store, calls, out = ProfileStore(tmp_path), [], io.StringIO()

    def measure(key):
        def run():
            calls.append(key)
            return _profile(key)
        return run

    first = load_or_measure(store, KEY, measure(KEY), out=out)
    again = load_or_measure(store, KEY, measure(KEY), out=out)
    other = dataclasses.replace(KEY, dtype="bfloat16")
    store.save(_profile(), store.path_for(other))  # a stale file under the other key's name
    load_or_measure(store, other, measure(other), out=out)
    forced = load_or_measure(store, KEY, measure(KEY), force=True, out=out)
    assert calls == [KEY, other, KEY] and first == again == forced
    text = out.getvalue()
    assert "reusing" in text and "dtype differs (stored 'float32', wanted 'bfloat16')" in text


@pytest.mark.parametrize("text, why", [
    ("not json at all", "not JSON"),
    (json.dumps([1, 2]), "a JSON list, not an object"),
    (json.dumps({"dp": 1, "plan": {"stages": []}, "parallel_pp_toml": None}), "no profile 'format' or 'key' key"),
    (json.dumps({"format": 1, "units": []}), "no profile 'key' key"),
])
@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("explicit", [False, True])
def test_load_or_measure_never_overwrites_a_file_that_is_not_a_profile(tmp_path, text, why, force, explicit):
    store, calls = ProfileStore(tmp_path), []
    target = tmp_path / "mine.json" if explicit else store.path_for(KEY)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)

    def measure():
        calls.append(1)
        return _profile()

    with pytest.raises(ValueError, match=f"profile file {target} exists and is not a plait profile .*{why}"):
        load_or_measure(store, KEY, measure, path=target if explicit else None, force=force, out=io.StringIO())
    assert calls == [] and target.read_text() == text  # refused before measuring, file untouched
    with pytest.raises(ValueError, match="refusing to overwrite"):
        store.save(_profile(), target)
    assert target.read_text() == text


def test_load_or_measure_replaces_a_profile_of_another_key_or_format(tmp_path):
    store, out = ProfileStore(tmp_path), io.StringIO()
    target = tmp_path / "p.json"
    store.save(_profile(dataclasses.replace(KEY, dtype="bfloat16")), target)  # a readable profile, other key
    assert load_or_measure(store, KEY, _profile, path=target, out=out) == _profile()
    assert "stale: dtype differs" in out.getvalue() and store.load(KEY, target)[1] == "hit"
    target.write_text(json.dumps({"format": 0, "key": {"dtype": "float32"}}))  # an older plait profile
    assert load_or_measure(store, KEY, _profile, path=target, out=out) == _profile()
    assert "profile format 0 is not 1" in out.getvalue() and store.load(KEY, target)[1] == "hit"
