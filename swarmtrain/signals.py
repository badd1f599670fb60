"""Graceful stops however a process was started.

Python installs its Ctrl+C handler (``KeyboardInterrupt``) only when SIGINT is not ignored at start, and a
background job of a non-interactive shell, a process under many service managers or a test runner started from a
script inherits SIGINT ignored: such a process could not be stopped gracefully, and whatever it holds (shared
memory segments, stage processes, an unwritten checkpoint) was lost with a later SIGKILL. ``stop_on_signals``
turns SIGINT, SIGTERM and SIGHUP into ``KeyboardInterrupt`` while it is active, so every entry point stops the same
way on Ctrl+C, ``kill`` or a closed terminal.

Two handlers it leaves alone: one that someone else installed (an asyncio loop's signal handlers, a caller's own)
and a SIGHUP that was ignored at start, which is how ``nohup`` asks a process to survive its terminal.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def _ours_to_take(sig: signal.Signals, handler: Any) -> bool:
    """Whether ``handler`` is only the interpreter's default, which we may replace."""
    if sig == signal.SIGHUP:
        return handler == signal.SIG_DFL  # SIG_IGN: nohup asked us to outlive the terminal
    return handler in (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler, None)


@contextmanager
def stop_on_signals(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """While active, SIGINT, SIGTERM and SIGHUP raise ``KeyboardInterrupt`` in the main thread (also when SIGINT was
    ignored at start); the previous handlers come back on exit. Does nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    replaced: dict[signal.Signals, Callable[..., Any] | int | None] = {}
    for sig in signals:
        previous = signal.getsignal(sig)
        if _ours_to_take(sig, previous):
            replaced[sig] = previous
            signal.signal(sig, _interrupt)
    try:
        yield
    finally:
        for sig, previous in replaced.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def handled_by_loop(sig: signal.Signals) -> bool:
    """Whether an asyncio loop should take ``sig`` for a graceful stop: always SIGINT and SIGTERM, and SIGHUP unless
    it was ignored at start (``nohup``)."""
    return sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN
