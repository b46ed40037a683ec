"""plait import of a damaged checkpoint folder: a broken config.json, no weights, a truncated or damaged
safetensors file, a shard its index names but that is missing: one ``plait: error: --from <dir>: ...`` line naming
the file, as for a missing folder, no traceback; nothing is written to --out."""

import json
import shutil
from pathlib import Path

import pytest

from plait.cli import main
from plait.commands.import_hf import check_weights, import_checkpoint
from tests.unit.commands.tiny_hf_checkpoints import save_llava


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    return save_llava(tmp_path_factory.mktemp("hf") / "llava")


def _copy(llava: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(llava, tmp_path / "src"))


def _cli_error(src: Path, tmp_path: Path, capsys) -> str:
    assert main(["import", "--from", str(src), "--out", str(tmp_path / "imp")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not (tmp_path / "imp").exists()
    return err.strip()


def test_a_broken_config_is_named_in_one_line(llava, tmp_path, capsys):
    src = _copy(llava, tmp_path)
    (src / "config.json").write_text("{bad\n")
    err = _cli_error(src, tmp_path, capsys)
    assert err.startswith(f"plait: error: --from {src}: cannot read {src / 'config.json'}: ")
    assert "\n" not in err and "not a valid JSON file" in err


def test_missing_weights_are_named(llava, tmp_path, capsys):
    src = _copy(llava, tmp_path)
    (src / "model.safetensors").unlink()
    assert _cli_error(src, tmp_path, capsys) == (
        f"plait: error: --from {src}: no weights (none of model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin, pytorch_model.bin.index.json; a Hugging Face checkpoint folder, as save_pretrained "
        "writes it)")


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_a_damaged_safetensors_file_is_named(llava, tmp_path, capsys, damage):
    src = _copy(llava, tmp_path)
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\xff" * 8 + data[8:])
    err = _cli_error(src, tmp_path, capsys)
    assert err.startswith(f"plait: error: --from {src}: {weights} is not a readable safetensors file (truncated or "
                          "damaged: ")
    assert "\n" not in err


def test_a_shard_the_index_names_must_exist(llava, tmp_path):
    src = _copy(llava, tmp_path)
    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"^--from {src}: the weight file {src / 'model-00002-of-00002.safetensors'} "
                                         rf"is missing \(named by {src / 'model.safetensors.index.json'}\)$"):
        import_checkpoint(src, tmp_path / "imp")
    (src / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ValueError, match=rf"^--from {src}: cannot read the weight index "):
        check_weights(src)


def test_an_intact_folder_passes_the_check(llava):
    assert check_weights(llava) == [llava / "model.safetensors"]
