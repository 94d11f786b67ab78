"""The configuration-error boundary of ``run.py`` / ``servelab``: a mistake prints one message and exits 2;
``HYDRA_FULL_ERROR=1`` keeps the traceback; errors while running are not swallowed."""

from __future__ import annotations

import os

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from framework.entrypoints import config_errors


def test_set_up_errors_exit_2_with_the_message_alone(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_info, config_errors.exit_on_config_error():
        raise ValueError("engine.max_num_seqs must be >= 1")
    assert exit_info.value.code == config_errors.EXIT_CODE
    assert capsys.readouterr().err == "servelab: error: engine.max_num_seqs must be >= 1\n"
    with pytest.raises(KeyError), config_errors.exit_on_config_error():  # not a configuration mistake
        raise KeyError("a bug")


def test_hydra_full_error_keeps_the_traceback(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ValueError, match="bad"), config_errors.exit_on_config_error():
        raise ValueError("bad")
    with pytest.raises(MissingConfigException):
        config_errors.run_app(lambda: _raise(MissingConfigException("x", "attention/nope", ["torch"])))


def test_unknown_option_lists_the_valid_ones_without_the_search_path(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    missing = MissingConfigException("In 'config': Could not find 'attention/nope'\n\nConfig search path:\n\tx",
                                     "attention/nope", ["torch_paged", "torch"])
    assert config_errors.hydra_error_message(missing) == "unknown attention 'nope'; valid: torch, torch_paged"
    other = ConfigCompositionException("Could not override 'engine.x'.\nConfig search path:\n\tpkg://hydra.conf")
    assert config_errors.hydra_error_message(other) == "Could not override 'engine.x'."
    with pytest.raises(SystemExit) as exit_info:
        config_errors.run_app(lambda: _raise(missing))
    assert exit_info.value.code == 2 and "valid: torch, torch_paged" in capsys.readouterr().err
    assert "HYDRA_FULL_ERROR" not in os.environ  # restored after the app


def _raise(err: BaseException) -> None:
    raise err
