"""Every bad speculative_config is a ConfigError of one line, and `kiln generate` prints it as
one line and exits 2 (issue 57: 11 of 20 bad values gave 20-26-line tracebacks; K = 1e9 was
accepted)."""

from __future__ import annotations

import json

import pytest

from kiln.cli.main import main
from kiln.config import EngineConfig
from kiln.errors import ConfigError
from kiln.spec_decode.config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
BAD = {
    "unknown method": {**NGRAM, "method": "medusa"},
    "K 0": {**NGRAM, "num_speculative_tokens": 0},
    "K negative": {**NGRAM, "num_speculative_tokens": -2},
    "K 1e9": {**NGRAM, "num_speculative_tokens": 10**9},
    "K text": {**NGRAM, "num_speculative_tokens": "3"},
    "K float": {**NGRAM, "num_speculative_tokens": 2.5},
    "min > max": {**NGRAM, "prompt_lookup_min": 6, "prompt_lookup_max": 2},
    "min text": {**NGRAM, "prompt_lookup_min": "a"},
    "unknown key": {**NGRAM, "lookahead": 3},
    "no method": {"num_speculative_tokens": 3},
    "draft without model": {"method": "draft_model", "num_speculative_tokens": 3},
    "model not text": {"method": "draft_model", "num_speculative_tokens": 3, "model": 5},
    "layers 0": {**NGRAM, "draft_num_hidden_layers": 0},
    "table of text": {**NGRAM, "num_speculative_tokens_by_batch_size": {"a": 1}},
    "table a list": {**NGRAM, "num_speculative_tokens_by_batch_size": [1]},
    "disable 0": {**NGRAM, "disable_by_batch_size": 0},
    "not a dict": "ngram",
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_speculative_config_is_one_config_error(case):
    with pytest.raises(ConfigError) as err:
        EngineConfig(speculative_config=BAD[case])  # type: ignore[arg-type]
    assert "speculative_config" in str(err.value) and "\n" not in str(err.value)


def test_a_good_one_still_parses():
    assert SpeculativeConfig.from_dict(NGRAM).num_speculative_tokens == 3


@pytest.mark.parametrize("case", ["K 1e9", "min text", "table of text"])
def test_kiln_generate_prints_one_line_and_exits_2(case, capsys):
    code = main(["generate", "--speculative-config", json.dumps(BAD[case]), "hi"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
