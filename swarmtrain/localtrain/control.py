"""The run's control block in shared memory: abort/stop flags, the step horizon, per-stage state and counters.

One segment, created by the parent. The parent writes the global words (abort, stop, horizon) and commands;
each stage writes only its own slot (pid, state, steps done, acknowledgements, timing counters, error text),
so every word has a single writer and no lock is needed. Commands are sequence-numbered: the parent writes
the command and then bumps ``cmd_seq``; the stage handles it between steps and sets ``ack_seq`` to match.
"""

from __future__ import annotations

import enum

import numpy as np

from swarmtrain.localtrain.shm import Segments, attach_segment, close_segment

MAGIC = 0x5357_5443_544C_0001  # "SWTCTL" v1
_INT_WORDS_GLOBAL = 16
_INT_STRIDE = 16
_FLOAT_STRIDE = 16
ERROR_BYTES = 4096
# global words
_MAGIC, _STAGES, _ABORT, _STOP, _HORIZON, _OWNER_PID = range(6)
# per-stage words
_PID, _STATE, _STEPS, _CMD_SEQ, _CMD, _ACK_SEQ, _ERROR_LEN = range(7)


class StageState(enum.IntEnum):
    STARTING = 0
    READY = 1
    RUNNING = 2
    DONE = 3
    FAILED = 4


class Command(enum.IntEnum):
    NONE = 0
    GATHER = 1  # copy parameters into the stage's parameter segment
    LOAD = 2  # copy parameters from the stage's parameter segment


class Stat(enum.IntEnum):
    """Per-stage timing counters (seconds unless noted), summed over steps."""

    BUSY = 0  # forward, backward and optimizer
    WAIT_INPUT = 1  # waiting for the previous stage's activation
    WAIT_OUTPUT = 2  # back-pressure: waiting for a free slot downstream
    WAIT_SNAPSHOT = 3  # waiting for a fresh enough readout snapshot (or upstream readout gradients, owner)
    COMM = 4  # copying into and out of rings and snapshots
    WALL = 5  # from the first step's start to the last step's end
    LOSS = 6  # last local loss (nats per byte)
    LAG_SUM = 7  # snapshot versions behind the live readout, summed over steps
    LAG_MAX = 8
    STEPS = 9


class Control:
    def __init__(self, shm, stages: int) -> None:
        self.stages = stages
        self._shm = shm
        int_words = _INT_WORDS_GLOBAL + stages * _INT_STRIDE
        self._ints = np.ndarray((int_words,), dtype=np.int64, buffer=shm.buf, offset=0)
        float_offset = int_words * 8
        self._floats = np.ndarray((stages, _FLOAT_STRIDE), dtype=np.float64, buffer=shm.buf, offset=float_offset)
        error_offset = float_offset + stages * _FLOAT_STRIDE * 8
        self._errors = np.ndarray((stages, ERROR_BYTES), dtype=np.uint8, buffer=shm.buf, offset=error_offset)

    @staticmethod
    def size(stages: int) -> int:
        return (_INT_WORDS_GLOBAL + stages * _INT_STRIDE) * 8 + stages * (_FLOAT_STRIDE * 8 + ERROR_BYTES)

    @classmethod
    def create(cls, segments: Segments, stages: int, owner_pid: int) -> Control:
        control = cls(segments.create("ctl", cls.size(stages)), stages)
        control._ints[:] = 0
        control._floats[:] = 0.0
        control._ints[_MAGIC], control._ints[_STAGES], control._ints[_OWNER_PID] = MAGIC, stages, owner_pid
        return control

    @classmethod
    def attach(cls, name: str, stages: int) -> Control:
        control = cls(attach_segment(name), stages)
        if control._ints[_MAGIC] != MAGIC or control._ints[_STAGES] != stages:
            control.detach()
            raise ValueError(f"shared-memory segment {name} is not a control block for {stages} stages")
        return control

    @property
    def name(self) -> str:
        return self._shm.name

    def _word(self, stage: int, word: int) -> int:
        return _INT_WORDS_GLOBAL + stage * _INT_STRIDE + word

    # -- global (parent writes) ------------------------------------------------------------------------------
    @property
    def aborted(self) -> bool:
        return bool(self._ints[_ABORT])

    def abort(self) -> None:
        self._ints[_ABORT] = 1

    @property
    def stopping(self) -> bool:
        return bool(self._ints[_STOP])

    def stop(self) -> None:
        self._ints[_STOP] = 1

    @property
    def horizon(self) -> int:
        """Stages may run steps ``< horizon``; the parent raises it, a stage waits at it."""
        return int(self._ints[_HORIZON])

    @horizon.setter
    def horizon(self, value: int) -> None:
        self._ints[_HORIZON] = value

    @property
    def owner_pid(self) -> int:
        return int(self._ints[_OWNER_PID])

    def send(self, stage: int, command: Command) -> int:
        """Post a command to a stage; return the sequence number its acknowledgement will carry."""
        self._ints[self._word(stage, _CMD)] = int(command)
        seq = int(self._ints[self._word(stage, _CMD_SEQ)]) + 1
        self._ints[self._word(stage, _CMD_SEQ)] = seq
        return seq

    # -- per stage (the stage writes its own slot) -----------------------------------------------------------
    def pending(self, stage: int) -> tuple[int, Command] | None:
        seq = int(self._ints[self._word(stage, _CMD_SEQ)])
        if seq == int(self._ints[self._word(stage, _ACK_SEQ)]):
            return None
        return seq, Command(int(self._ints[self._word(stage, _CMD)]))

    def ack(self, stage: int, seq: int) -> None:
        self._ints[self._word(stage, _ACK_SEQ)] = seq

    def acked(self, stage: int) -> int:
        return int(self._ints[self._word(stage, _ACK_SEQ)])

    def pid(self, stage: int) -> int:
        return int(self._ints[self._word(stage, _PID)])

    def set_pid(self, stage: int, pid: int) -> None:
        self._ints[self._word(stage, _PID)] = pid

    def state(self, stage: int) -> StageState:
        return StageState(int(self._ints[self._word(stage, _STATE)]))

    def set_state(self, stage: int, state: StageState) -> None:
        self._ints[self._word(stage, _STATE)] = int(state)

    def steps_done(self, stage: int) -> int:
        return int(self._ints[self._word(stage, _STEPS)])

    def set_steps_done(self, stage: int, steps: int) -> None:
        self._ints[self._word(stage, _STEPS)] = steps

    def stats(self, stage: int) -> np.ndarray:
        """The stage's ``Stat`` counters (a live float64 view; the stage adds to it, the parent reads it)."""
        return self._floats[stage]

    def set_error(self, stage: int, text: str) -> None:
        data = text.encode("utf-8", "replace")[-ERROR_BYTES:]
        self._errors[stage, : len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._ints[self._word(stage, _ERROR_LEN)] = len(data)

    def error(self, stage: int) -> str:
        length = int(self._ints[self._word(stage, _ERROR_LEN)])
        return self._errors[stage, :length].tobytes().decode("utf-8", "replace")

    def detach(self) -> None:
        self._ints = self._floats = self._errors = None  # type: ignore[assignment]
        close_segment(self._shm)
