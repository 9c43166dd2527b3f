"""A chat template that fails (here: one the sandbox refuses) is an InvalidRequestError of one
line, which `kiln generate` prints and exits 2 on (issue 57: a 41-line traceback)."""

from __future__ import annotations

import os

import pytest

from kiln.cli.main import main

# The sandbox refuses attribute access to dunders: the classic template escape.
ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"


@pytest.fixture(scope="module")
def refused_template_model(tmp_path_factory) -> str:
    from tests.tiny_tokenizer import build_tiny_chat_model

    path = build_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-escape")))
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(ESCAPE)
    return path


def test_kiln_generate_on_a_refused_template_is_one_line_and_exit_2(refused_template_model, capsys):
    code = main(["generate", "--model", refused_template_model, "--max-tokens", "2", "hi"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "chat template" in lines[0], err
    assert "Traceback" not in err
