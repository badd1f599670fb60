"""train.device: which device the standard trainer computes on, its errors, and the device-move path.

CI has no GPU: the move path is parametrised over the devices present, so it runs on ``cpu`` here with the code
a CUDA or MPS node runs (the device is a parameter, nothing else differs).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from swarmtrain.cli import main
from swarmtrain.data import load_corpus
from swarmtrain.errors import ConfigError
from swarmtrain.node.inner import StandardLoop
from swarmtrain.train.device import present_devices, resolve_device

from .conftest import tiny_config


def test_auto_takes_the_best_present_device_and_cpu_is_always_present() -> None:
    present = present_devices()
    assert present[-1] == "cpu"
    assert resolve_device("auto") == torch.device(present[0])
    assert resolve_device("cpu") == torch.device("cpu")


def test_an_absent_device_is_exit_2_naming_what_is_present(
    tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    absent = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: absent on every machine
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--data", str(text_file), "--run-dir", str(tmp_path / "run"), "--set", f"train.device={absent}",
              "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "model.context=32"])  # fmt: skip
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"train.device = '{absent}'" in err and f"present: {', '.join(present_devices())}" in err, err
    assert not (tmp_path / "run").exists()  # nothing written for a run that could not start


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_asking_for_cuda_without_a_gpu_names_the_cpu() -> None:
    with pytest.raises(ConfigError, match=r"train.device = 'cuda'.*present: .*cpu"):
        resolve_device("cuda")


def test_device_values_are_checked_and_localtrain_refuses_a_gpu(tmp_path: Path, text_file: Path) -> None:
    with pytest.raises(ConfigError, match=r"train.device = 'gpu' is invalid"):
        tiny_config(tmp_path, text_file, **{"train.device": "gpu"})
    with pytest.raises(ConfigError, match=r"localtrain runs its stages on the CPU only.*train.device = 'cuda'"):
        tiny_config(tmp_path, text_file, **{"train.trainer": "localtrain", "train.device": "cuda"})
    with pytest.raises(ConfigError, match=r"node.inner_time_s needs train.trainer = standard"):
        tiny_config(tmp_path, text_file, **{"train.trainer": "localtrain", "node.inner_time_s": 2.0})
    local = {"train.trainer": "localtrain", "model.exits": [1], "train.device": "cpu"}
    assert tiny_config(tmp_path, text_file, **local).train.device == "cpu"


@pytest.mark.parametrize("device", present_devices())
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_parameters_cross_between_the_device_and_the_cpu_as_fp32_copies(
    tmp_path: Path, text_file: Path, device: str, precision: str
) -> None:
    torch.set_num_threads(1)
    config = tiny_config(tmp_path, text_file, **{"train.device": device, "train.precision": precision})
    loop = StandardLoop(config, load_corpus(config.data), data_seed=1)
    assert loop.device == device and all(p.device == torch.device(device) for p in loop.trainer.model.parameters())

    theta = loop.vector()
    assert theta.device.type == "cpu" and theta.dtype == torch.float32
    theta_g = theta + 0.01  # what the outer step would hand back
    loop.load_vector(theta_g)
    assert torch.equal(loop.vector(), theta_g)  # bit for bit through the device and back
    theta_g.zero_()  # the trainer holds its own copy, not a view of the caller's tensor
    assert not torch.equal(loop.vector(), theta_g)

    before = loop.vector()
    loss, tokens, _ = loop.run(3)
    after = loop.vector()
    assert tokens == 3 * config.train.batch_size * config.model.context and loss == loss
    assert not torch.equal(before, after)
    after.zero_()  # the vector handed out is a copy too
    assert not torch.equal(loop.vector(), after)
    # Weights and AdamW state stay fp32 on the device under bf16 autocast; a checkpoint is on the CPU.
    assert all(p.dtype == torch.float32 for p in loop.trainer.model.parameters())
    states = [v for s in loop.trainer.optimizer.state.values() for v in s.values() if v.dim() > 0]
    assert states and all(v.dtype == torch.float32 and v.device == torch.device(device) for v in states)
    tensors, _ = loop.state(loop.vector())
    assert all(t.device.type == "cpu" for t in tensors.values())


def test_a_round_by_time_trains_until_the_budget_and_at_least_one_step(tmp_path: Path, text_file: Path) -> None:
    torch.set_num_threads(1)
    config = tiny_config(tmp_path, text_file)
    loop = StandardLoop(config, load_corpus(config.data), data_seed=1)
    per_step = config.train.batch_size * config.model.context
    started = time.perf_counter()
    _, tokens, seconds = loop.run(1, time_s=0.5, step_delay_s=0.1)
    assert seconds >= 0.5 and time.perf_counter() - started >= 0.5
    assert tokens % per_step == 0 and 2 <= tokens // per_step <= 6, tokens // per_step  # 0.1 s + a step each
    _, tokens, _ = loop.run(1, time_s=1e-9)
    assert tokens == per_step  # a budget shorter than a step still contributes one
