from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from swarmtrain.data import load_corpus
from swarmtrain.errors import CheckpointError
from swarmtrain.train import Trainer, latest_checkpoint, list_checkpoints, run_training, save_checkpoint
from swarmtrain.train.checkpoint import read_checkpoint

from .conftest import tiny_config


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path: Path, text_file: Path) -> None:
    config = tiny_config(tmp_path, text_file)
    corpus = load_corpus(config.data)
    torch.set_num_threads(1)
    straight = Trainer(config, corpus)
    for _ in range(20):
        straight.train_step()

    first = Trainer(config, corpus)
    for _ in range(10):
        first.train_step()
    tensors, meta = first.state()
    path = save_checkpoint(tmp_path / "run", tensors, meta, keep=2)
    resumed = Trainer(config, corpus)
    resumed.load_state(read_checkpoint(path))
    for _ in range(10):
        resumed.train_step()

    assert resumed.step == straight.step == 20 and resumed.tokens == straight.tokens
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_bf16_computes_in_bf16_and_keeps_fp32_weights(tmp_path: Path, text_file: Path) -> None:
    torch.set_num_threads(1)
    corpus = load_corpus(tiny_config(tmp_path, text_file).data)
    runs = {}
    for precision in ("fp32", "bf16"):
        trainer = Trainer(tiny_config(tmp_path, text_file, **{"train.precision": precision}), corpus)
        losses = [trainer.train_step() for _ in range(30)]
        runs[precision] = (trainer, losses)
    bf16, losses = runs["bf16"]
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert sum(losses[-5:]) < sum(losses[:5]) * 0.8  # it learns
    fp32 = runs["fp32"][0].model.state_dict()
    # Same seed and data: only the precision of the passes differs, and it shows in the weights.
    assert any(not torch.equal(v, fp32[k]) for k, v in bf16.model.state_dict().items())


def test_training_lowers_held_out_bpb_and_checkpoints(tmp_path: Path, text_file: Path) -> None:
    config = tiny_config(tmp_path, text_file, **{"train.max_steps": 60, "train.eval_every": 30})
    final = run_training(config)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 0 and records[0]["bpb"] > 7.5  # ~8 bits: uniform over bytes
    assert records[-1]["step"] == 60 and final == records[-1]["bpb"] < 5.0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["width"] == 32
    assert latest_checkpoint(tmp_path / "run").step == 60


def test_resume_continues_and_refuses_a_different_model(tmp_path: Path, text_file: Path) -> None:
    run_training(tiny_config(tmp_path, text_file, **{"train.max_steps": 10}))
    with pytest.raises(CheckpointError, match="already holds a run"):
        run_training(tiny_config(tmp_path, text_file, **{"train.max_steps": 20}))
    run_training(tiny_config(tmp_path, text_file, **{"train.max_steps": 20}), resume=True)
    assert latest_checkpoint(tmp_path / "run").step == 20

    before = {p.name: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    wider = tiny_config(tmp_path, text_file, **{"train.max_steps": 30, "model.width": 64})
    with pytest.raises(CheckpointError, match=r"model.width=32 there vs 64 here"):
        run_training(wider, resume=True)
    after = {p.name: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert after == before  # a failed start damages nothing


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from swarmtrain.train import save_checkpoint
    run_dir = sys.argv[1]
    for step in range(1, 10_000):
        tensors = {"w": torch.full((4_000_000,), float(step))}
        save_checkpoint(run_dir, tensors, {"step": step}, keep=2)
    """
)


def test_kill_9_during_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ckpt_dir = run_dir / "checkpoints"
    caught_mid_write = False
    for _ in range(5):  # each attempt is bounded; the writer is slow enough that one is nearly always enough
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(run_dir)])
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if list_checkpoints(run_dir) and any(p.name.endswith(".tmp") for p in ckpt_dir.iterdir()):
                    os.kill(proc.pid, signal.SIGKILL)
                    caught_mid_write = True
                    break
                time.sleep(0.001)
        finally:
            proc.kill()
            proc.wait(timeout=10)
        if caught_mid_write:
            break
    assert caught_mid_write, "never saw a checkpoint write in progress"
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None
    assert torch.equal(checkpoint.tensors["w"], torch.full((4_000_000,), float(checkpoint.step)))
    for path in list_checkpoints(run_dir):
        read_checkpoint(path)  # every checkpoint under a checkpoint's name is whole


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMTRAIN_")}
    return subprocess.run(
        [sys.executable, "-m", "swarmtrain", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--data", "missing.txt"], "does not exist"),
        (["--set", "train.batch_sise=4"], "Did you mean train.batch_size"),
        (["--set", "model.context=4096", "--data", "small.txt"], "fewer than one window"),
    ],
)
def test_cli_errors_are_one_paragraph_without_traceback(tmp_path: Path, args: list[str], needle: str) -> None:
    (tmp_path / "small.txt").write_text("hello world, " * 100)
    result = _cli("train", "--run-dir", "run", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_cli_trains_and_names_the_final_bpb_last(tmp_path: Path, text_file: Path) -> None:
    result = _cli(
        "train", "--data", str(text_file), "--run-dir", "run", "--max-steps", "5",
        "--set", "model.depth=1", "--set", "model.width=32", "--set", "model.context=32", "--set", "train.threads=1",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("held-out bpb ") and float(last.split()[-1]) < 8.5
