"""A Jinja syntax error in data.chat_template is reported against the template file and line when it is read,
not against the first record rendered with it."""

import pytest

from plait.data.chat_template import read_chat_template, template_names


def test_broken_template_file_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jinja"
    path.write_text("{% for m in messages %}\n{{ m['content'] }}\n{{ m['role']} }}\n{% endfor %}\n")
    with pytest.raises(ValueError) as err:
        read_chat_template(str(path))
    assert str(err.value) == f"data.chat_template {path} line 3: unexpected '}}'"


def test_valid_template_file_is_returned_unchanged(tmp_path):
    path = tmp_path / "ok.jinja"
    text = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path.write_text(text)
    assert read_chat_template(str(path)) == text


def test_committed_templates_parse():
    for name in template_names():
        assert read_chat_template(name)
