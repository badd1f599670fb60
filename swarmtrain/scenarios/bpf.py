"""Packet loss for a scenario's links where the kernel has no ``netem``: a tc classifier that drops a share of them.

The classifier is six eBPF instructions, loaded with the ``bpf()`` system call (through ctypes: no compiler, no
library) and attached in direct-action mode by ``tc filter ... bpf da object-pinned``, for which it is pinned for a
moment in a bpf filesystem mounted for that moment:

    r0 = bpf_get_prandom_u32()
    if (u32) r0 >= loss * 2**32: return TC_ACT_OK     # the packet goes on
    return TC_ACT_SHOT                                # the packet is dropped

Losses are the kernel's, so TCP sees and repairs them as it would on a lossy link (retransmits, a smaller window).
Needs root, a kernel with BPF and ``cls_bpf``, and x86-64 or arm64 (the system call's number).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import struct
import subprocess
import tempfile
from collections.abc import Iterator

from swarmtrain.scenarios.spec import ScenarioError

_SYS_BPF = {"x86_64": 321, "aarch64": 280}
_PROG_LOAD, _OBJ_PIN = 5, 6
_SCHED_CLS = 3  # BPF_PROG_TYPE_SCHED_CLS: a tc classifier
_GET_PRANDOM_U32 = 7
_TC_ACT_OK, _TC_ACT_SHOT = 0, 2
_ATTR_SIZE = 128  # enough of union bpf_attr for both commands; the rest stays zero


def _insn(code: int, dst: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst, off, imm)


def drop_instructions(loss: float) -> bytes:
    """The classifier's bytecode: drop a packet when a random u32 falls below ``loss`` of its range."""
    threshold = min(round(loss * 2**32), 2**32 - 1)
    imm = struct.unpack("<i", struct.pack("<I", threshold))[0]  # the instruction's field is signed
    return b"".join([
        _insn(0x85, imm=_GET_PRANDOM_U32),  # call
        _insn(0x36, dst=0, off=2, imm=imm),  # jmp32 jge (unsigned): skip the drop
        _insn(0xB7, dst=0, imm=_TC_ACT_SHOT), _insn(0x95),  # r0 = SHOT; exit
        _insn(0xB7, dst=0, imm=_TC_ACT_OK), _insn(0x95),  # r0 = OK; exit
    ])  # fmt: skip


def _bpf(command: int, attr: bytes) -> int:
    number = _SYS_BPF.get(platform.machine())
    if number is None:
        raise ScenarioError(
            f"scenario error: link loss is not supported on {platform.machine()}; remove up_loss/down_loss."
        )
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(attr, _ATTR_SIZE)
    result = libc.syscall(number, command, buffer, _ATTR_SIZE)
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return result


def _load(loss: float) -> int:
    """A file descriptor of the loaded classifier."""
    code = drop_instructions(loss)
    instructions = ctypes.create_string_buffer(code, len(code))
    license_, log = ctypes.create_string_buffer(b"GPL"), ctypes.create_string_buffer(4096)
    attr = struct.pack(
        "<IIQQIIQ", _SCHED_CLS, len(code) // 8, ctypes.addressof(instructions), ctypes.addressof(license_), 1,
        len(log), ctypes.addressof(log),
    )  # fmt: skip
    try:
        return _bpf(_PROG_LOAD, attr)
    except OSError as exc:
        verifier = log.value.decode(errors="replace").strip()
        raise ScenarioError(
            f"scenario error: the kernel refused the link-loss program ({exc}{'; ' + verifier if verifier else ''}). "
            "Link loss needs root and a kernel with BPF; remove up_loss/down_loss to run without it."
        ) from None


@contextlib.contextmanager
def pinned_drop(loss: float) -> Iterator[str]:
    """The path of the classifier for ``loss``, pinned while the block runs (tc opens it by path)."""
    fd = _load(loss)
    folder = tempfile.mkdtemp(prefix="swarmtrain-bpf-")
    mounted = False
    try:
        path = os.path.join(folder, "drop")
        try:
            subprocess.run(["mount", "-t", "bpf", "bpf", folder], check=True, capture_output=True)
            mounted = True
            name = ctypes.create_string_buffer(path.encode())
            _bpf(_OBJ_PIN, struct.pack("<QII", ctypes.addressof(name), fd, 0))
        except (OSError, subprocess.CalledProcessError) as exc:
            raise ScenarioError(f"scenario error: could not pin the link-loss program for tc ({exc}).") from None
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", folder], check=False, capture_output=True)  # the pin goes with it
        os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(folder)
