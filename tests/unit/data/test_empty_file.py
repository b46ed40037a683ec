"""A data file with no record is refused naming the file, before the metadata pass (which has nothing to
concatenate)."""

from __future__ import annotations

import re

import pytest

from plait.data.loader import MultimodalDataset
from tests.helpers.processing import setup  # noqa: F401  (fixture: tokenizer, model, processor)


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_a_file_without_records_names_the_file(setup, tmp_path, text):
    _, _, proc = setup
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} holds no record$"):
        MultimodalDataset(path, proc)
