"""localtrain leaves the process that ran it as it found it (threads, CPU affinity, the garbage collector),
and a timeout names the stage it waited for."""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from swarmtrain.config import LocalTrainConfig
from swarmtrain.data import load_corpus
from swarmtrain.localtrain.errors import LocalTrainError
from swarmtrain.localtrain.trainer import LocalTrainer
from tests.conftest import localtrain_config

CTX = mp.get_context("spawn")
pytestmark = [pytest.mark.usefixtures("reap_children"), pytest.mark.timeout(120)]


def test_a_serial_run_gives_its_caller_its_threads_back(tmp_path: Path, text_file: Path) -> None:
    config = localtrain_config(tmp_path, text_file, steps=2)
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        lt = LocalTrainConfig(method="rgc-serial", stages=2, threads=1)
        with LocalTrainer(config, load_corpus(config.data), lt) as trainer:
            trainer.train_step()
            assert torch.get_num_threads() == 1  # the run used its own budget
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


def test_a_pinned_async_run_gives_its_caller_its_affinity_and_threads_back(
    tmp_path: Path, text_file: Path, prefix: str
) -> None:
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        pytest.skip("pinning two stages to their own cores needs two cores")
    config = localtrain_config(tmp_path, text_file, steps=2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    lt = LocalTrainConfig(method="rgc-async", stages=2, threads=2, pin_cores=True, wait_timeout=30, start_timeout=60)
    try:
        with LocalTrainer(config, load_corpus(config.data), lt, prefix=prefix) as trainer:
            assert len(os.sched_getaffinity(0)) == 1 and torch.get_num_threads() == 1  # the owner stage, pinned
            trainer.train_step()
        assert os.sched_getaffinity(0) == cores and torch.get_num_threads() == 2
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(before)


def test_a_stage_that_does_not_start_in_time_is_named(tmp_path: Path, text_file: Path, prefix: str) -> None:
    config = localtrain_config(tmp_path, text_file, steps=2)
    lt = LocalTrainConfig(method="rgc-async", stages=2, threads=2, start_timeout=0.001)
    with pytest.raises(LocalTrainError, match=r"stage 0 \(pid \d+\) did not start within localtrain.start_timeout"):
        LocalTrainer(config, load_corpus(config.data), lt, prefix=prefix)


def zygote_freeze_counts(out: str) -> None:
    from swarmtrain.localtrain.zygote import start_zygote

    before = gc.get_freeze_count()
    zygote = start_zygote()
    during = gc.get_freeze_count()  # frozen while the zygote serves: its children share these pages
    zygote.close()
    Path(out).write_text(json.dumps({"before": before, "during": during, "after": gc.get_freeze_count()}))


def test_the_zygote_leaves_the_interpreter_as_it_found_it(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    proc = CTX.Process(target=zygote_freeze_counts, args=(str(out),))
    proc.start()
    proc.join(timeout=90)
    assert proc.exitcode == 0, f"the run process ended with {proc.exitcode}"
    counts = json.loads(out.read_text())
    assert counts["before"] == 0 and counts["during"] > 0, counts
    assert counts["after"] == 0, counts  # nothing left frozen in the process that started it
