"""`swarmtrain doctor` (each failure with the message it prints) and the config check a node makes before training."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmtrain.cli import main
from swarmtrain.config import load_config
from swarmtrain.net import MemoryNetwork
from swarmtrain.node.doctor import check_clock
from swarmtrain.node.settings import ConfigMismatch, ask_settings, check_settings, serve_settings, swarm_settings
from swarmtrain.train.device import present_devices
from tests.swarm import TINY, Swarm


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """Run `swarmtrain doctor ARGS` in this process; its exit status and what it printed."""
    with pytest.raises(SystemExit) as exited:
        main(["doctor", *args])
        raise SystemExit(0)
    out = capsys.readouterr()
    return int(exited.value.code or 0), out.out + out.err


def tiny(text_file: Path, tmp_path: Path) -> list[str]:
    args = ["--data", str(text_file), "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    for item in TINY:
        args += ["--set", item]
    return args


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (mounting needs root; without it the test is skipped and says why)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_doctor_names_a_disk_too_small_for_the_checkpoints(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, small_fs: Path
) -> None:
    code, out = doctor(capsys, "--run-dir", str(small_fs / "run"), "--data", str(tmp_path / "missing.txt"))
    assert code == 1
    assert "FAIL  disk for checkpoints: 1 MiB free at" in out and "fix: free space there" in out, out
    assert "FAIL  data:" in out and "missing.txt" in out, out  # every check runs, each failure is listed


def test_doctor_names_an_unwritable_run_dir(capsys: pytest.CaptureFixture[str], small_fs: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    code, out = doctor(capsys, "--run-dir", str(small_fs), "--set", "model.depth=1")
    assert code == 1
    assert f"FAIL  run directory: cannot write to {small_fs} (Read-only file system)" in out, out
    assert f"fix: give --run-dir a directory you can write to, or make it writable (chmod u+w {small_fs})" in out


def test_doctor_names_the_device_the_inner_steps_run_on_and_an_absent_one(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text_file: Path
) -> None:
    absent = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: absent on every machine
    args = [*tiny(text_file, tmp_path), "--run-dir", str(tmp_path / "run")]
    code, out = doctor(capsys, *args, "--set", f"train.device={absent}")
    present = ", ".join(present_devices())
    assert code == 1
    assert f"FAIL  device: train.device = '{absent}' is not on this machine (present: {present})" in out, out
    assert "fix: set train.device to a present device, or to auto to take the best one" in out, out
    assert "ok    p2p daemon" in out, out  # the other checks still ran

    code, out = doctor(capsys, *args)
    assert code == 0, out
    best = present_devices()[0]
    assert f"ok    device: {best}" in out, out
    if best == "cpu":  # auto found no GPU: the line says why, so a user with one knows what to fix
        assert "no GPU found (torch " in out and ("CPU-only build" in out or "CUDA finds no GPU" in out), out


def test_doctor_names_an_announced_address_nobody_answers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text_file: Path
) -> None:
    """Starts p2p daemons: run it under the heavy-test lock."""
    args = [*tiny(text_file, tmp_path), "--run-dir", str(tmp_path / "run"), "--announce", "/ip4/127.0.0.1/tcp/1"]
    code, out = doctor(capsys, *args)
    assert code == 1
    assert "ok    p2p daemon: started as" in out, out
    assert "FAIL  announced address: no daemon answers at /ip4/127.0.0.1/tcp/1 (node.announce)" in out, out
    assert "fix: set --announce to this machine's public address" in out


async def test_a_node_whose_settings_differ_is_told_which_key_and_what_the_swarm_uses() -> None:
    net = MemoryNetwork()
    swarm_config = load_config(overrides=["model.width=128", "averaging.codec=int8"])
    for name in ("a", "b", "c"):
        await serve_settings(net.transport(name), swarm_settings(swarm_config))
    joiner = net.transport("d")
    mine = swarm_settings(load_config(overrides=["model.width=64", "averaging.codec=int8"]))
    with pytest.raises(ConfigMismatch) as mismatch:
        await check_settings(joiner, ["a", "b", "c"], mine)
    assert mismatch.value.summary == "model.width = 64 here, the swarm uses 128"
    assert "--set model.width=128" in str(mismatch.value)
    assert await check_settings(joiner, ["a", "b", "c"], swarm_settings(swarm_config)) == 3
    # One odd peer does not speak for the swarm: the majority's settings are the swarm's.
    await serve_settings(net.transport("odd"), mine)
    assert await check_settings(joiner, ["odd", "a", "b"], swarm_settings(swarm_config)) == 3


async def test_a_clock_far_from_the_peers_is_named_by_doctor_and_warned_of_by_a_joining_node(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Peer "ahead" runs 30 s ahead of this machine: doctor fails the clock check naming it and the fix, the node's
    settings check (which does not stop it) logs the same; peers within the bound pass."""
    net = MemoryNetwork()
    settings = swarm_settings(load_config())
    await serve_settings(net.transport("Qm-in-step"), settings)
    await serve_settings(net.transport("Qm-close-by"), settings, clock=lambda: time.time() - 0.5)
    await serve_settings(net.transport("Qm-ahead"), settings, clock=lambda: time.time() + 30)
    joiner = net.transport("joiner")
    fine = check_clock(await ask_settings(joiner, ["Qm-in-step", "Qm-close-by"]))
    assert fine.ok and fine.detail.startswith("within 0.5") and fine.detail.endswith("of 2 peers"), fine
    check = check_clock(await ask_settings(joiner, ["Qm-in-step", "Qm-ahead"]))
    assert not check.ok
    assert "more than 2 s from the peers' (Qm-ahead 30.0 s ahead)" in check.detail, check.detail
    assert "timedatectl set-ntp true" in check.fix
    with caplog.at_level(logging.WARNING, logger="swarmtrain.node.settings"):
        assert await check_settings(joiner, ["Qm-in-step", "Qm-ahead"], settings) == 2
    assert "Qm-ahead 30.0 s ahead" in caplog.text and "timedatectl" in caplog.text, caplog.text


@pytest.mark.slow
def test_doctor_and_a_joining_node_compare_the_config_with_a_running_swarm(
    swarm: Swarm, capsys: pytest.CaptureFixture[str], tmp_path: Path, text_file: Path
) -> None:
    """One node process runs; doctor with its config passes, with another run id or model width fails naming the
    key; a node started with another width exits before training with the same message. Heavy-test lock."""
    swarm.start("a", rounds=1000, extra=["node.test_step_delay_s=0.2"])
    address = swarm.join_line("a")
    base = [*tiny(text_file, tmp_path), "--run-dir", str(tmp_path / "doc"), "--join", address]
    code, out = doctor(capsys, *base)
    assert code == 0, out
    assert "ok    config: run id, protocol, model shape and exits, codec match the swarm's" in out
    assert "ok    reachable from the swarm: reachable at /ip4/127.0.0.1/tcp/" in out, out
    code, out = doctor(capsys, *base, "--set", "node.run_id=other")
    assert code == 1
    assert "FAIL  config node.run_id: 'other' here, the swarm uses 'swarmtrain'" in out, out
    assert "fix: --set node.run_id=swarmtrain" in out
    code, out = doctor(capsys, *base, "--set", "model.width=64")
    assert code == 1
    assert "FAIL  config model.width: 64 here, the swarm uses 32" in out and "fix: --set model.width=32" in out, out
    joiner = swarm.start("b", rounds=3, join=address, extra=["model.width=64"])
    assert joiner.wait(timeout=120 * swarm.slowdown) == 2, swarm.log("b")
    assert "config mismatch: model.width = 64 here, the swarm uses 32" in swarm.log("b")
    assert swarm.rounds("b") == []  # it never trained
