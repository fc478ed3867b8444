"""What the engine process takes from `restore-complete`: the weight stager's socket, by file name only."""

from __future__ import annotations

import logging

import pytest

from warmstart.api.control_dir import RESTORE_COMPLETE, Signal
from warmstart.worker.engine_process import _expect_staged_weights


class _Engine:
    def __init__(self) -> None:
        self.socket: str | None = None

    def expect_staged_weights(self, socket_path: str) -> None:
        self.socket = socket_path


def _signal(payload: dict) -> Signal:
    return Signal(RESTORE_COMPLETE, payload)


def test_the_socket_is_looked_for_in_the_engines_own_control_directory() -> None:
    engine = _Engine()
    _expect_staged_weights(engine, _signal({"weight_stager_socket": "weight-stager.sock"}), "/run/ctl")
    assert engine.socket == "/run/ctl/weight-stager.sock"


@pytest.mark.parametrize("name", ["../elsewhere.sock", "/tmp/x.sock", ".hidden", "", 7])
def test_anything_but_a_plain_file_name_is_ignored(name: object, caplog: pytest.LogCaptureFixture) -> None:
    engine = _Engine()
    with caplog.at_level(logging.ERROR):
        _expect_staged_weights(engine, _signal({"weight_stager_socket": name}), "/run/ctl")
    assert engine.socket is None
    assert "not a file name" in caplog.text


def test_no_stager_no_socket_and_engines_without_staging_are_left_alone() -> None:
    engine = _Engine()
    _expect_staged_weights(engine, _signal({}), "/run/ctl")
    assert engine.socket is None
    _expect_staged_weights(object(), _signal({"weight_stager_socket": "s.sock"}), "/run/ctl")
