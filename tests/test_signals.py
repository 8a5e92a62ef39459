"""``fpaudit._signals.deferred``: SIGINT and SIGTERM inside the block arrive after it,
once each, and the handlers the block found are the ones left after it."""

from __future__ import annotations

import signal

import pytest

from fpaudit import _signals


def test_a_signal_inside_the_block_arrives_after_it_once() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: seen.append(number))
    try:
        with _signals.deferred():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)  # a second one during the block
            assert seen == []
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_ctrl_c_inside_the_block_is_a_keyboard_interrupt_after_it() -> None:
    # Python's own Ctrl-C handler, whatever an earlier test left in place
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    finished = False
    try:
        with pytest.raises(KeyboardInterrupt), _signals.deferred():
            signal.raise_signal(signal.SIGINT)
            finished = True  # the block runs to its end first
        assert finished
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_ignored_signal_stays_ignored() -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with _signals.deferred():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
            signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
