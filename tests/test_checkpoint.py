"""Checkpoints keep the last good state: checksums catch damage, retention never counts a damaged file, and
``--resume`` falls back to the newest checkpoint that passes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from swarmtrain.errors import CheckpointError
from swarmtrain.train import latest_checkpoint, list_checkpoints, run_training, save_checkpoint
from swarmtrain.train.checkpoint import read_checkpoint

from .conftest import tiny_config


def save(run_dir: Path, step: int, keep: int) -> Path:
    return save_checkpoint(run_dir, {"w": torch.full((1000,), float(step))}, {"step": step}, keep=keep)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_bit(path: Path, offset_from_end: int = 100) -> None:
    """Flip one bit in the tensor data (the end of the file), leaving the header readable."""
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("keep", [1, 2])
def test_a_truncated_newest_checkpoint_never_leaves_the_run_without_a_loadable_one(tmp_path: Path, keep: int) -> None:
    run_dir = tmp_path / "run"
    save(run_dir, 100, keep=2)
    save(run_dir, 200, keep=2)
    truncate(list_checkpoints(run_dir)[-1])
    resumed = latest_checkpoint(run_dir)
    assert resumed is not None and resumed.step == 100  # resume skips the broken file
    save(run_dir, 150, keep=keep)  # the resumed run saves its next checkpoint
    intact = [read_checkpoint(p).step for p in list_checkpoints(run_dir)]
    assert intact == [100, 150][-keep:], f"checkpoints left: {[p.name for p in list_checkpoints(run_dir)]}"
    latest = latest_checkpoint(run_dir)
    assert latest is not None and latest.step == 150
    # The broken file is set aside under a name that says so, not deleted and not counted.
    assert (run_dir / "checkpoints" / "step-00000200.safetensors.corrupt").is_file()


def test_a_flipped_bit_is_detected_on_load_and_resume_falls_back(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    save(run_dir, 1, keep=2)
    newest = save(run_dir, 2, keep=2)
    flip_bit(newest)
    with pytest.raises(CheckpointError, match="fails its checksum .tensor w is damaged"):
        read_checkpoint(newest)
    resumed = latest_checkpoint(run_dir)
    assert resumed is not None and resumed.step == 1
    assert torch.equal(resumed.tensors["w"], torch.full((1000,), 1.0))


def test_damaged_metadata_is_detected_on_load(tmp_path: Path) -> None:
    path = save(tmp_path / "run", 7, keep=2)
    data = path.read_bytes()
    # Same length, still valid JSON: the step number in the metadata changes from 7 to 9.
    damaged = data.replace(b'\\"step\\": 7', b'\\"step\\": 9')
    assert damaged != data
    path.write_bytes(damaged)
    with pytest.raises(CheckpointError, match="metadata is damaged"):
        read_checkpoint(path)


def test_train_resume_skips_a_damaged_checkpoint_and_cleans_temp_files(tmp_path: Path, text_file: Path) -> None:
    settings = {"train.max_steps": 6, "train.checkpoint_every": 3, "train.eval_every": 100}
    run_training(tiny_config(tmp_path, text_file, **settings))
    run_dir = tmp_path / "run"
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-00000003.safetensors", "step-00000006.safetensors"]
    flip_bit(list_checkpoints(run_dir)[-1])
    stale = run_dir / "checkpoints" / ".step-00000009.safetensors.abc123.tmp"  # left by a kill -9 mid-write
    stale.write_bytes(b"half a checkpoint")
    out = io.StringIO()
    run_training(tiny_config(tmp_path, text_file, **{**settings, "train.max_steps": 8}), True, Console(file=out))
    printed = out.getvalue()
    assert "skipped step-00000006.safetensors" in printed and "fails its checksum" in printed, printed
    assert "resumed from step-00000003.safetensors at step 3" in printed, printed
    assert not stale.exists()
    latest = latest_checkpoint(run_dir)
    assert latest is not None and latest.step == 8
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert evals[-1]["step"] == 8


def test_resume_refuses_only_when_no_checkpoint_passes_and_names_each(tmp_path: Path, text_file: Path) -> None:
    settings = {"train.max_steps": 4, "train.checkpoint_every": 2, "train.eval_every": 100}
    run_training(tiny_config(tmp_path, text_file, **settings))
    first, second = list_checkpoints(tmp_path / "run")
    truncate(first)
    flip_bit(second)
    with pytest.raises(CheckpointError, match="no readable checkpoint") as refused:
        run_training(tiny_config(tmp_path, text_file, **{**settings, "train.max_steps": 6}), resume=True)
    assert first.name in str(refused.value) and second.name in str(refused.value)
    assert "fails its checksum" in str(refused.value) and "cannot be read" in str(refused.value)
