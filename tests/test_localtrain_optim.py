"""The stages' AdamW and clipping against torch's, and global backprop against ``swarmtrain.train.Trainer``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarmtrain.data import load_corpus
from swarmtrain.localtrain.config import LocalTrainConfig
from swarmtrain.localtrain.optim import AdamW, clip_grad_norm
from swarmtrain.localtrain.trainer import LocalTrainer
from swarmtrain.model import param_groups
from swarmtrain.train import Trainer
from tests.conftest import tiny_config

pytestmark = pytest.mark.timeout(60)


def test_adamw_and_clipping_match_torch() -> None:
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    theirs = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    theirs.load_state_dict(ours.state_dict())
    opt_ours = AdamW(param_groups(ours, 0.1), lr=1e-2, betas=(0.9, 0.95))
    opt_theirs = torch.optim.AdamW(param_groups(theirs, 0.1), lr=1e-2, betas=(0.9, 0.95), foreach=True)
    for step in range(5):
        x = torch.randn(32, 8)
        for model in (ours, theirs):
            (model(x) ** 2).mean().backward()
        norm = clip_grad_norm(ours.parameters(), 0.05)
        expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05)
        assert norm == pytest.approx(float(expected), rel=1e-6)
        for group in [*opt_ours.param_groups, *opt_theirs.param_groups]:
            group["lr"] = 1e-2 * (step + 1) / 5
        opt_ours.step()
        opt_theirs.step()
        opt_ours.zero_grad()
        opt_theirs.zero_grad(set_to_none=True)
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_global_backprop_engine_trains_exactly_like_the_trainer(tmp_path: Path, text_file: Path) -> None:
    config = tiny_config(tmp_path, text_file, **{"model.depth": 3})
    corpus = load_corpus(config.data)
    reference = Trainer(config, corpus)
    with LocalTrainer(config, corpus, LocalTrainConfig(method="global-bp", threads=1)) as ours:
        for _ in range(5):
            assert ours.train_step() == pytest.approx(reference.train_step(), rel=1e-5)
        for name, value in reference.model.state_dict().items():
            torch.testing.assert_close(ours.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert ours.evaluate() == pytest.approx(reference.evaluate(), rel=1e-5)


def test_a_stage_step_does_not_import_torch_dynamo(tmp_path: Path, text_file: Path) -> None:
    """The memory reason for our AdamW: a stage process must stay free of torch._dynamo (~70 MiB)."""
    config = tiny_config(tmp_path, text_file)
    code = (
        "import sys\n"
        "from swarmtrain.config import Config\n"
        "from swarmtrain.data import load_corpus\n"
        "from swarmtrain.localtrain.config import LocalTrainConfig\n"
        "from swarmtrain.localtrain.trainer import LocalTrainer\n"
        f"config = Config.model_validate_json({config.model_dump_json()!r})\n"
        "with LocalTrainer(config, load_corpus(config.data), LocalTrainConfig(method='rgc-serial', threads=1)) as t:\n"
        "    t.train_step()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
