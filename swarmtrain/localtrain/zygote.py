"""A fork server forked from this process right after ``import torch``, so stages share torch's pages.

``import torch`` leaves ~146 MB of private memory in every process that runs it (relocated libraries, Python
objects); a spawned stage pays it again. A *zygote* is ``os.fork()``-ed once, early, before any torch op could
start OpenMP threads (a child forked after that hangs in its first parallel op); on request it forks a child
that runs a stage. The main process, the zygote and its children then share the imported pages copy-on-write,
so the process tree pays for them about once. Each child sets its own thread budget (``setup_threads``) before
its first op, as a spawned stage does.

    zygote = start_zygote()  # first thing in an entry point, before any torch op
    try:
        ...  # PipelineEngine forks its stages from take_zygote(), or spawns them when there is none
    finally:
        zygote.close()

A zygote serves one pipeline: ``take_zygote`` hands it over, and the pipeline retires it once its stages run,
because the zygote's own copy of the pages that both the main process and a stage have since written is held by
nobody else (~60 MiB for an 8-layer width-128 model). The main process is made a child subreaper
(``PR_SET_CHILD_SUBREAPER``), so the stages become its children when the zygote exits and it reaps them; where
that is not available the zygote stays until the pipeline closes and reaps them itself. The main process sees a
stage through ``ForkedProcess`` (liveness by pid, a zombie counts as dead) and the control block, and kills by
pid. The zygote ignores SIGINT (the main process handles Ctrl+C and stops the stages) and exits when the main
process closes its pipe or dies; a stage whose parent is then neither the zygote nor the main process leaves,
as a spawned stage does when the main process dies.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

from swarmtrain.localtrain.errors import LocalTrainError
from swarmtrain.localtrain.shm import pid_alive

log = logging.getLogger(__name__)

REPLY_TIMEOUT = 30.0
PR_SET_CHILD_SUBREAPER = 36
_current: Zygote | None = None


def _become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux >= 3.4); False where that is not possible."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[-1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


class ForkedProcess:
    """A zygote's child seen from the main process: the parts of ``multiprocessing.Process`` the pipeline uses."""

    def __init__(self, pid: int, zygote_pid: int, name: str) -> None:
        self.pid, self.zygote_pid, self.name = pid, zygote_pid, name
        self.exitcode: int | None = None  # known once this process reaped it (after the zygote retired)

    def is_alive(self) -> bool:
        if self.exitcode is not None:
            return False
        try:
            done, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # still the zygote's child (the zygote reaps it), or already reaped
            return pid_alive(self.pid)
        if not done:
            return True
        self.exitcode = os.waitstatus_to_exitcode(status)
        return False

    def join(self, timeout: float | None = None) -> None:
        deadline = float("inf") if timeout is None else time.monotonic() + timeout
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL, only while the pid is still the zygote's or ours (so a reused pid is never hit)."""
        if self.is_alive() and _parent_of(self.pid) in (self.zygote_pid, os.getpid()):
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Zygote:
    """The main process's handle on its zygote (``start_zygote`` makes one)."""

    def __init__(self, pid: int, conn: Connection, subreaper: bool, froze: bool = False) -> None:
        self.pid, self.owner = pid, os.getpid()
        self.subreaper = subreaper  # this process adopts the zygote's children when it exits
        self._conn: Connection | None = conn
        self._froze = froze  # start_zygote froze this process's objects; close() unfreezes them

    @property
    def usable(self) -> bool:
        return self._conn is not None and os.getpid() == self.owner and pid_alive(self.pid)

    def start(self, target: Callable[..., Any], args: tuple[Any, ...], name: str) -> ForkedProcess:
        """Fork a child of the zygote that runs ``target(*args)`` and exits with 0, or 1 on an exception."""
        if self._conn is None:
            raise LocalTrainError("the zygote is closed")
        self._conn.send((target, args, name))
        if not self._conn.poll(REPLY_TIMEOUT):
            raise LocalTrainError(f"the zygote (pid {self.pid}) did not answer within {REPLY_TIMEOUT:.0f} s")
        pid = self._conn.recv()
        if isinstance(pid, str):
            raise LocalTrainError(f"the zygote could not start {name}: {pid}")
        return ForkedProcess(pid, self.pid, name)

    def close(self, timeout: float = 10.0) -> None:
        """``retire`` the zygote and unfreeze what ``start_zygote`` froze in this process (call it once the
        zygote's children are done); safe to call twice."""
        self.retire(timeout)
        if self._froze and os.getpid() == self.owner:
            gc.unfreeze()
            self._froze = False

    def retire(self, timeout: float = 10.0) -> None:
        """Close the pipe (the zygote reaps what has exited and leaves) and reap the zygote; safe to call twice."""
        global _current
        if _current is self:
            _current = None
        if self._conn is None or os.getpid() != self.owner:
            return
        self._conn.close()
        self._conn = None
        deadline = time.monotonic() + timeout
        while True:
            try:
                done, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return
            if done:
                return
            if time.monotonic() > deadline:
                log.warning("the zygote (pid %d) did not exit in time; killing it", self.pid)
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                return
            time.sleep(0.02)

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def current_zygote() -> Zygote | None:
    """This process's zygote, if it started one that still runs (never one inherited through a fork)."""
    return _current if _current is not None and _current.usable else None


def take_zygote() -> Zygote | None:
    """Hand this process's zygote to one pipeline (later pipelines spawn their stages); None if there is none."""
    global _current
    zygote = current_zygote()
    _current = None
    return zygote


def start_zygote(close_fds: Iterable[Any] = ()) -> Zygote:
    """Import torch and the stage code, then fork the zygote; call before any torch op in this process.

    ``close_fds``: connections or descriptors of this process that the zygote and the stages must not hold
    (e.g. the pipe a result goes back on, so that its reader sees EOF when this process ends).
    """
    global _current
    import torch  # noqa: F401  (imported before the fork: this is what the children share)

    import swarmtrain.localtrain.worker  # noqa: F401  (the stage code and its imports, shared too)

    if _current is not None and _current.usable:
        return _current
    ours, theirs = Pipe()
    to_close = list(close_fds)
    # The cyclic GC writes into the header of every object it scans, which would copy each page of torch's
    # Python objects into every process; objects frozen here are never scanned again, so their pages stay shared.
    # Only the children need that: this process unfreezes right after the fork (leaving the interpreter as it
    # found it), unless its own code had frozen objects already, and then it freezes nothing.
    # This process stays frozen while the zygote's children run (its pages stay shared with theirs), and
    # ``Zygote.close`` unfreezes it, leaving the interpreter as it found it. If the caller had frozen objects
    # itself, nothing is frozen here (and nothing unfrozen).
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.collect()
        gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except BaseException:
        if freeze:
            gc.unfreeze()
        raise
    if pid == 0:  # the zygote
        code = 1
        try:
            ours.close()
            for handle in to_close:
                _close(handle)
            _serve(theirs)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    theirs.close()
    _current = Zygote(pid, ours, _become_subreaper(), froze=freeze)
    return _current


def _close(handle: Any) -> None:
    try:
        handle.close() if hasattr(handle, "close") else os.close(handle)
    except OSError:
        pass


def _serve(conn: Connection) -> None:
    """The zygote's loop: fork a child per request, reap children, leave when the main process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    children: set[int] = set()
    while os.getppid() == parent:
        _reap(children)
        try:
            if not conn.poll(0.2):
                continue
            target, args, name = conn.recv()
        except (EOFError, OSError):
            break
        try:
            pid = _fork_child(conn, target, args)
        except OSError as exc:
            conn.send(f"{type(exc).__name__}: {exc}")
            continue
        children.add(pid)
        conn.send(pid)
    _reap(children)  # children still running are adopted by the main process (a subreaper), or by init


def _reap(children: set[int]) -> None:
    for pid in list(children):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            children.discard(pid)


def _fork_child(conn: Connection, target: Callable[..., Any], args: tuple[Any, ...]) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        conn.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        target(*args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0  # not reached
