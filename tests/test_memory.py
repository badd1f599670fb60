"""A node's process keeps the multi-MB blocks its rounds free for the next round (``swarmtrain.memory``). Nodes run
on Linux with glibc (the README's requirements; torch's Linux wheels need glibc), so this holds wherever one runs."""

from __future__ import annotations

import subprocess
import sys

# A round's receiving, as a member's transport does it: 15 frames of 2 MB arrive and stay alive together, each
# written to, then all are freed. Prints the page faults per round over 20 rounds after a first one.
ROUNDS = """
import resource, sys
from swarmtrain.memory import reuse_freed_memory
if sys.argv[1] == "tuned":
    assert reuse_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def receive():
    frames = []
    for _ in range(15):
        frame = bytearray(2_000_000)
        for page in range(0, len(frame), 4096):
            frame[page] = 1
        frames.append(frame)
receive()
before = faults()
for _ in range(20):
    receive()
print((faults() - before) / 20)
"""


def faults_per_round(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


def test_frames_freed_in_one_round_are_reused_by_the_next_without_faulting_their_pages_in_again() -> None:
    default, tuned = faults_per_round("default"), faults_per_round("tuned")
    # 30 MB of frames are about 7,300 pages: with glibc's defaults each round faults most of them in again.
    assert default > 1000, f"{default} page faults per round without the setting: the pattern does not show it"
    assert tuned < default / 20, f"{tuned} page faults per round with the setting, {default} without"
