"""The evaluator's channel: JSON frames over a socket pair, and the polling wait of timing."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from kernelfleet.evaluator._wire import Channel, ChannelClosed


def channels() -> tuple[Channel, Channel]:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Channel(mine), Channel(theirs)


def send_later(channel: Channel, message: dict[str, Any], seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, channel.send, args=(message,))
    timer.start()
    return timer


def test_a_polling_receive_takes_a_message_that_comes_while_it_polls() -> None:
    mine, theirs = channels()
    send_later(theirs, {"op": "round", "index": 1}, 0.05).join()
    send_later(theirs, {"op": "round", "index": 2}, 0.05)
    assert mine.receive(spin_s=5.0) == {"op": "round", "index": 1}
    assert mine.receive(spin_s=5.0) == {"op": "round", "index": 2}


def test_a_polling_receive_sleeps_on_when_its_poll_ends_first() -> None:
    mine, theirs = channels()
    send_later(theirs, {"op": "bye"}, 0.2)
    assert mine.receive(spin_s=0.01) == {"op": "bye"}


def test_a_polling_receive_keeps_its_timeout_and_sees_the_other_side_close() -> None:
    mine, theirs = channels()
    with pytest.raises(TimeoutError):
        mine.receive(timeout=0.05, spin_s=1.0)
    theirs.close()
    with pytest.raises(ChannelClosed):
        mine.receive(spin_s=1.0)


def test_polling_keeps_the_waiting_thread_running_and_sleeping_does_not() -> None:
    """What the setting is for: a side that polls is on a CPU when its request comes."""

    def cpu_seconds_waiting(spin_s: float) -> float:
        mine, theirs = channels()
        send_later(theirs, {"op": "round"}, 0.3)
        begin = time.thread_time()
        mine.receive(spin_s=spin_s)
        return time.thread_time() - begin

    assert cpu_seconds_waiting(spin_s=5.0) > 0.05
    assert cpu_seconds_waiting(spin_s=0.0) < 0.05
