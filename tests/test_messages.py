"""Errors for bad input say what is wrong, where it came from and how to fix it, and exit with code 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from swarmtrain.cli import main
from swarmtrain.config import load_config
from swarmtrain.data import load_corpus

TINY = ["--set", "model.depth=2", "--set", "model.width=32", "--set", "model.heads=2", "--set", "train.threads=1"]


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """Run the CLI in process; it must exit with code 2. Returns (stdout, stderr) as one paragraph each."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    assert exited.value.code == 2, (out, err)
    assert "Traceback" not in err
    return " ".join(out.split()), " ".join(err.split())


def test_a_bad_join_names_the_flag_and_the_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, err = fails(["node", "--join", "/ip4/203.0.113.5/tcp/31337", "--run-dir", str(tmp_path / "run")], capsys)
    assert "node.join entry '/ip4/203.0.113.5/tcp/31337' lacks the peer id" in err, err
    assert "(from the --join flag)" in err and "/p2p/12D3KooW" in err, err
    assert "from defaults" not in err and "{'join'" not in err, err  # not the whole section, not the wrong source


def test_an_unknown_model_key_suggests_a_model_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, err = fails(["train", "--set", "model.bogus=3", "--run-dir", str(tmp_path / "run")], capsys)
    assert "model.bogus is not a known setting (from --set model.bogus=3)" in err, err
    hint = err.split("model.bogus=3).", 1)[1]
    assert "depth" in hint and "context" in hint and "node." not in hint, err


def test_a_corpus_shorter_than_the_context_gets_a_fix_that_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = tmp_path / "small.txt"
    small.write_text("hello world, " * 50)  # 650 bytes: the held-out tail (5 %) is 32 bytes, context is 128
    _, err = fails(["train", "--data", str(small), "--run-dir", str(tmp_path / "run")], capsys)
    assert "fewer than one window of model.context + 1 = 129 bytes" in err, err
    assert "N < " not in err, err
    suggested = re.findall(r"--set (model\.context|data\.val_fraction)=([0-9.]+)", err)
    assert {key for key, _ in suggested} == {"model.context", "data.val_fraction"}, err
    for key, value in suggested:  # each fix on its own makes the corpus fit
        config = load_config(flags={"data.path": str(small), key: float(value) if "." in value else int(value)})
        load_corpus(config.data).check_context(config.model.context)


def test_a_config_file_that_is_not_utf8_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.toml"
    path.write_bytes("[train]\nlr = 0.01  # réglé\n".encode("latin-1"))
    _, err = fails(["train", "--config", str(path), "--run-dir", str(tmp_path / "run")], capsys)
    assert f"{path} is not UTF-8 text" in err and "UTF-8" in err and "iconv" in err, err


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("reap_children")
def test_localtrain_bench_checks_its_config_before_the_reference_run(
    tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["localtrain", "bench", "--data", str(text_file), "--steps", "4", "--seeds", "1", *TINY]
    argv += ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "localtrain.stage_threads=[0,1]"]
    out, err = fails(argv, capsys)
    assert "localtrain.stage_threads [0, 1] must hold localtrain.stages (2) counts of at least 1" in err, err
    assert "global-bp" not in out, out  # the reference did not run first
