from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarmtrain.config import known_keys, load_config, write_resolved
from swarmtrain.errors import ConfigError


def test_sources_apply_in_order_file_env_set_flags(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[train]\nlr = 0.01\nbatch_size = 4\nseed = 1\n[model]\nwidth = 64\n")
    env = {"SWARMTRAIN_TRAIN__BATCH_SIZE": "8", "SWARMTRAIN_TRAIN__SEED": "2", "HOME": "/x"}
    config = load_config(path, ["train.seed=3", "model.exits=[1]"], {"train.lr": 0.5, "run_dir": None}, environ=env)
    assert config.train.lr == 0.5  # flag beats file
    assert config.train.batch_size == 8  # environment beats file
    assert config.train.seed == 3  # --set beats environment
    assert config.model.width == 64 and config.model.exits == [1]
    assert config.run_dir == "runs/default"  # an unset flag hides nothing


@pytest.mark.parametrize(
    ("toml", "env", "needle"),
    [
        ("[train]\nbatch_sise = 4\n", {}, "train.batch_sise is not a known setting (from "),
        ("", {"SWARMTRAIN_TRAIN__BATCH_SISE": "4"}, "environment variable SWARMTRAIN_TRAIN__BATCH_SISE"),
        ("[train]\nbatch_size = 'many'\n", {}, "train.batch_size = 'many' is invalid"),
        ("[model]\nwidth = 100\nheads = 3\n", {}, "model.width (100) must be divisible by model.heads (3)"),
        ("[train\n", {}, "is not valid TOML"),
    ],
)
def test_bad_config_names_the_key_and_the_fix(tmp_path: Path, toml: str, env: dict[str, str], needle: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=env)
    assert needle in str(info.value)


def test_misspelled_key_gets_a_suggestion(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Did you mean train.batch_size"):
        load_config(overrides=["train.batch_sise=4"], environ={})


def test_every_key_has_help_text() -> None:
    keys = known_keys()
    assert "train.lr" in keys and "model.depth" in keys
    assert all(keys.values()), [k for k, v in keys.items() if not v]


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    config = load_config(flags={"train.lr": 0.02}, environ={})
    path = write_resolved(config, tmp_path / "run")
    assert load_config(flags=dict(_flat(json.loads(path.read_text()))), environ={}) == config


def _flat(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ([], "set model.exits = [2] on every node of the swarm"),
        (["localtrain.stages=3"], "set model.exits = [2, 3] on every node"),
        (["localtrain.stages=5", "model.exits=[1, 2, 3]"], "localtrain.stages (5) must lie between 1 and model.depth"),
        (["localtrain.stages=1"], "needs localtrain.stages >= 2"),
        (["model.exits=[2]", "localtrain.stage_threads=[1]"], "localtrain.stage_threads [1] must hold"),
        (["model.exits=[2]", "localtrain.method=rgc-sync"], "localtrain.method = 'rgc-sync' is invalid"),
        (["model.exits=[2]", "localtrain.stagez=2"], "Did you mean localtrain.stages?"),
    ],
)
def test_localtrain_node_settings_are_checked(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["train.trainer=localtrain", *overrides], environ={})
    assert needle in str(info.value)


def test_localtrain_section_is_part_of_every_config(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[train]\ntrainer = "localtrain"\n[model]\nexits = [2, 3]\n[localtrain]\nmethod = "rgc-serial"\n')
    config = load_config(path, environ={"SWARMTRAIN_LOCALTRAIN__STAGES": "3"})
    lt = config.localtrain
    assert (config.train.trainer, lt.method, lt.stages) == ("localtrain", "rgc-serial", 3)
    assert "train.trainer" in known_keys() and "localtrain.stage_threads" in known_keys()
    global_bp = load_config(overrides=["localtrain.method=global-bp", "train.trainer=localtrain"], environ={})
    assert global_bp.model.exits == []  # global backprop has no stages, so no exits to agree on
