"""Ctrl-C during long runs: held until the state is whole, saved, then raised; resumes equal
uninterrupted runs."""

from __future__ import annotations

import os
import signal

import pytest

from elsi_fast._infra.interrupt import DeferredInterrupt


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_first_ctrl_c_is_held_until_the_loop_asks():
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with DeferredInterrupt("test state") as interrupt:
            for step in range(5):
                if step == 1:
                    _ctrl_c()
                steps.append(step)  # the step in which Ctrl-C came still runs to its end
                assert interrupt.requested == (step >= 1)
                interrupt.raise_if_requested()
    assert steps == [0, 1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_second_ctrl_c_stops_at_once(capsys):
    with pytest.raises(KeyboardInterrupt):
        with DeferredInterrupt("test state"):
            _ctrl_c()
            _ctrl_c()
            pytest.fail("the second Ctrl-C did not raise")
    assert "Ctrl-C again" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_disabled_or_foreign_handler_leaves_ctrl_c_alone():
    with pytest.raises(KeyboardInterrupt):
        with DeferredInterrupt("test state", enabled=False):
            _ctrl_c()
            pytest.fail("Ctrl-C was held although disabled")
    seen = []
    previous = signal.signal(signal.SIGINT, lambda *a: seen.append(1))
    try:
        with DeferredInterrupt("test state") as interrupt:
            _ctrl_c()
        assert seen == [1] and not interrupt.requested
    finally:
        signal.signal(signal.SIGINT, previous)
