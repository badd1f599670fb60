"""Readout-Gradient Consensus and the serial methods, in process: the zero-lag property and its neighbours."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from swarmtrain.data import load_corpus, train_batch
from swarmtrain.errors import ConfigError
from swarmtrain.localtrain.config import (
    LocalTrainConfig,
    load_localtrain_config,
    split_threads,
    stage_bounds,
    staged_model_config,
)
from swarmtrain.localtrain.errors import LocalTrainError
from swarmtrain.localtrain.rgc import ReadoutConsensus, combine_readout_grads, cosine
from swarmtrain.localtrain.serial import SerialEngine
from swarmtrain.localtrain.stage import Stage, build_full, build_stage_modules, local_loss
from swarmtrain.localtrain.stats import paired_gap, t95
from swarmtrain.localtrain.trainer import LocalTrainer
from swarmtrain.model import VOCAB
from swarmtrain.train import Trainer
from swarmtrain.train.trainer import evaluate_bpb
from tests.conftest import tiny_config

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def staged(tmp_path: Path, text_file: Path, **overrides: object):
    settings = {"model.depth": 6, "model.width": 32, "model.heads": 2, "train.batch_size": 4}
    settings.update(overrides)
    return tiny_config(tmp_path, text_file, **settings)


def test_zero_lag_rgc_readout_gradient_equals_live_deep_supervision(tmp_path: Path, text_file: Path) -> None:
    """The paper's zero-lag property, on a 3-stage cut of a 6-block model."""
    config = staged(tmp_path, text_file)
    stages = 3
    batch = train_batch(load_corpus(config.data).train, 4, config.model.context, seed=0, step=0)
    x, y = batch[:, :-1], batch[:, 1:]
    bounds = stage_bounds(config.model.depth, stages)

    # Live deep supervision, written against the ByteTransformer API: detached stage inputs, one shared live
    # readout, the uniform average of every exit's loss.
    live = build_full(config, stages)
    h = live.embed_tokens(x)
    losses = []
    for start, end in bounds:
        h = live.run_blocks(h.detach() if start else h, start, end)
        losses.append(F.cross_entropy(live.exit_logits(h, end).reshape(-1, VOCAB), y.reshape(-1)))
    (sum(losses) / stages).backward()
    expected = live.readout_for(config.model.depth).weight.grad

    # RGC with zero lag: upstream stages differentiate against a snapshot of the same readout state.
    full = build_full(config, stages)
    modules = build_stage_modules(full, stages)
    snapshot = modules[-1].readout.weight.detach().clone()
    upstream, h = [], x
    for module in modules[:-1]:
        out = module(h)
        leaf = snapshot.clone().requires_grad_(True)
        local_loss(module.exit_norm(out), leaf, y).backward()
        upstream.append(leaf.grad)
        h = out.detach()
    owner = modules[-1]
    local_loss(owner.exit_norm(owner(h)), owner.readout.weight, y).backward()
    got = ReadoutConsensus(stages - 1).combine(owner.readout.weight.grad, upstream, [0] * (stages - 1))

    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert got.abs().max() > 0


def test_rgc_serial_with_zero_lag_trains_exactly_like_live_local(tmp_path: Path, text_file: Path) -> None:
    config = staged(tmp_path, text_file)
    corpus = load_corpus(config.data)
    rgc = SerialEngine(config, corpus, LocalTrainConfig(method="rgc-serial", stages=3, serial_lag=0))
    live = SerialEngine(config, corpus, LocalTrainConfig(method="live-local", stages=3))
    for _ in range(4):
        assert rgc.train_step() == pytest.approx(live.train_step(), rel=1e-5)
    for (name, a), (_, b) in zip(rgc.full.named_parameters(), live.full.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    assert rgc.consensus.summary()[0]["lag_max"] == 0


def test_stale_snapshots_change_the_result(tmp_path: Path, text_file: Path) -> None:
    config = staged(tmp_path, text_file)
    corpus = load_corpus(config.data)
    fresh = SerialEngine(config, corpus, LocalTrainConfig(method="rgc-serial", stages=2, serial_lag=0))
    stale = SerialEngine(config, corpus, LocalTrainConfig(method="rgc-serial", stages=2, serial_lag=2))
    for _ in range(4):
        fresh.train_step()
        stale.train_step()
    assert stale.consensus.summary()[0]["lag_max"] == 2
    assert not torch.equal(fresh.readout, stale.readout)


def test_every_method_starts_from_global_backprops_weights(tmp_path: Path, text_file: Path) -> None:
    config = staged(tmp_path, text_file)
    reference = Trainer(config, load_corpus(config.data)).model.state_dict()
    full = build_full(config, stages=3).state_dict()
    for name, value in reference.items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)


def test_stage_modules_partition_the_parameters(tmp_path: Path, text_file: Path) -> None:
    config = staged(tmp_path, text_file)
    full = build_full(config, stages=3)
    modules = build_stage_modules(full, 3)
    names = [m.full_name(n) for m in modules for n, _ in m.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters())
    full_params = dict(full.named_parameters())
    for m in modules:
        for n, p in m.named_parameters():
            assert p is full_params[m.full_name(n)]


def test_broadcast_serial_trains_the_readout_on_the_last_exit_only(tmp_path: Path, text_file: Path) -> None:
    config = staged(tmp_path, text_file, **{"train.grad_clip": 0.0})
    corpus = load_corpus(config.data)
    engine = SerialEngine(config, corpus, LocalTrainConfig(method="broadcast-serial", stages=2, serial_lag=1))
    stage = Stage(build_stage_modules(build_full(config, 2), 2)[1], config.train)
    batch = train_batch(corpus.train, 4, config.model.context, seed=0, step=0)
    # The owner alone, on the same input, gives the same readout update as the whole broadcast step.
    h = build_stage_modules(build_full(config, 2), 2)[0](batch[:, :-1]).detach()
    local_loss(stage.module.exit_norm(stage.module(h)), stage.module.readout.weight, batch[:, 1:]).backward()
    stage.apply()
    engine.train_step()
    torch.testing.assert_close(engine.readout, stage.module.readout.weight)


def test_local_methods_learn(tmp_path: Path, text_file: Path) -> None:
    config = staged(tmp_path, text_file, **{"train.max_steps": 30})
    corpus = load_corpus(config.data)
    for method in ("live-local", "rgc-serial", "broadcast-serial"):
        with LocalTrainer(config, corpus, LocalTrainConfig(method=method, stages=2, threads=1)) as trainer:
            before = evaluate_bpb(trainer.model, corpus.val, config)
            losses = [trainer.train_step() for _ in range(30)]
            after = trainer.evaluate()
        assert math.isfinite(after) and after < before - 0.5, method
        assert losses[-1] < losses[0]
        assert trainer.step == 30 and trainer.tokens == 30 * 4 * config.model.context


def test_readout_helpers() -> None:
    own = torch.tensor([[1.0, 0.0]])
    assert torch.equal(combine_readout_grads(own, []), own)
    torch.testing.assert_close(combine_readout_grads(own, [torch.tensor([[3.0, 2.0]])]), torch.tensor([[2.0, 1.0]]))
    assert cosine(own, -own) == pytest.approx(-1.0)
    assert cosine(own, torch.zeros(1, 2)) == 0.0
    consensus = ReadoutConsensus(1)
    consensus.combine(own, [-own], [2])
    summary = consensus.summary()[0]
    assert summary["cos_negative_frac"] == 1.0 and summary["lag_max"] == 2


@given(depth=st.integers(1, 64), stages=st.integers(1, 64))
def test_stage_bounds_cover_every_block_once(depth: int, stages: int) -> None:
    if stages > depth:
        with pytest.raises(LocalTrainError, match="localtrain.stages"):
            stage_bounds(depth, stages)
        return
    bounds = stage_bounds(depth, stages)
    assert bounds[0][0] == 0 and bounds[-1][1] == depth
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_staged_config_and_thread_split(tmp_path: Path, text_file: Path) -> None:
    config = staged(tmp_path, text_file)
    assert staged_model_config(config.model, 3).exits == [2, 4]
    with pytest.raises(LocalTrainError, match="shared_readout"):
        staged_model_config(config.model.model_copy(update={"shared_readout": False}), 2)
    assert split_threads(LocalTrainConfig(stages=2, threads=5)) == [3, 2]
    assert split_threads(LocalTrainConfig(stages=3, threads=2)) == [1, 1, 1]
    assert split_threads(LocalTrainConfig(stages=2, stage_threads=[1, 3])) == [1, 3]
    with pytest.raises(LocalTrainError, match="stage_threads"):
        split_threads(LocalTrainConfig(stages=2, stage_threads=[1]))


def test_localtrain_section_comes_from_file_environment_and_set(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[model]\ndepth = 6\nwidth = 64\n\n[localtrain]\nstages = 3\nring_depth = 4\n")
    config, lt = load_localtrain_config(
        path,
        ["localtrain.serial_lag=2", "model.width=32"],
        {"localtrain.stages": None, "localtrain.pin_cores": True},
        environ={"SWARMTRAIN_LOCALTRAIN__RING_DEPTH": "5", "SWARMTRAIN_MODEL__DEPTH": "8"},
    )
    assert (config.model.depth, config.model.width) == (8, 32)  # environment beats file, --set beats both
    assert (lt.stages, lt.ring_depth, lt.serial_lag, lt.pin_cores) == (3, 5, 2, True)
    with pytest.raises(ConfigError, match=r"localtrain.ring_dept is not a known setting .*Did you mean"):
        load_localtrain_config(None, ["localtrain.ring_dept=3"], environ={})
    with pytest.raises(ConfigError, match="localtrain.stages"):
        load_localtrain_config(None, ["localtrain.stages=0"], environ={})


def test_paired_gap_and_t_quantiles() -> None:
    assert t95(1) == pytest.approx(6.314) and t95(30) == pytest.approx(1.697)
    assert t95(31) == pytest.approx(1.6955, abs=2e-3) and t95(1000) == pytest.approx(1.6464, abs=1e-3)
    gap = paired_gap([1.01, 1.02, 1.03], [1.0, 1.0, 1.0])
    assert gap.mean_pct == pytest.approx(2.0)
    assert gap.upper95_pct == pytest.approx(2.0 + 2.920 * 1.0 / math.sqrt(3))
    assert not gap.passes(1.0)
    single = paired_gap([0.99], [1.0])
    assert math.isinf(single.upper95_pct) and not single.passes()
