from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from swarmtrain.config import DataConfig
from swarmtrain.data import eval_starts, load_corpus, load_parts, stdlib_root, train_batch
from swarmtrain.errors import DataError

from .conftest import english_like


def test_single_file_is_memory_mapped_with_a_held_out_tail(text_file: Path) -> None:
    corpus = load_corpus(DataConfig(path=str(text_file), val_fraction=0.1))
    raw = text_file.read_bytes()
    assert isinstance(corpus.train.base, np.memmap) or isinstance(corpus.train, np.memmap)
    assert len(corpus.train) + len(corpus.val) == len(raw)
    assert bytes(corpus.val) == raw[-len(corpus.val) :]
    assert len(corpus.val) == int(len(raw) * 0.1)


def test_folder_split_is_by_file_and_stable(tmp_path: Path) -> None:
    folder = tmp_path / "texts"
    for i in range(40):
        (folder / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (folder / f"d{i % 3}" / f"f{i}.txt").write_bytes(english_like(2000, seed=i))
    (folder / "image.bin").write_bytes(bytes(range(256)) * 10)  # binary: skipped
    config = DataConfig(path=str(folder), val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    first = load_corpus(config)
    assert len(first.train) + len(first.val) == 40 * 2000
    assert 0 < len(first.val) < len(first.train)
    # A new file changes the cache key but not which old files are held out.
    (folder / "d0" / "new.txt").write_bytes(english_like(2000, seed=99))
    second = load_corpus(config)
    assert bytes(first.val) in bytes(second.val) or bytes(second.val).startswith(bytes(first.val)[:1000])
    assert "41 files" in second.description


def test_default_corpus_is_the_stdlib_source(tmp_path: Path) -> None:
    corpus = load_corpus(DataConfig(cache_dir=str(tmp_path)))
    assert len(corpus.train) > 5_000_000 and len(corpus.val) > 100_000
    assert b"def " in bytes(corpus.train[:200_000])
    assert stdlib_root().joinpath("os.py").exists()
    again = load_corpus(DataConfig(cache_dir=str(tmp_path)))
    assert np.array_equal(corpus.val[:1000], again.val[:1000])


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "does not exist"),
        (b"", "is empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 100, "does not look like text"),
        (b"\xff\xfe\xfa" * 1000, "does not look like text"),
    ],
)
def test_bad_corpus_gives_a_clear_error(tmp_path: Path, content: bytes | None, needle: str) -> None:
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=needle):
        load_corpus(DataConfig(path=str(path)))


def test_empty_folder_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no non-empty text files"):
        load_corpus(DataConfig(path=str(tmp_path / "empty"), cache_dir=str(tmp_path / "cache")))


def test_context_larger_than_corpus_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "small.txt"
    path.write_bytes(english_like(1000))
    corpus = load_corpus(DataConfig(path=str(path)))
    corpus.check_context(32)
    with pytest.raises(DataError, match="validation split .* fewer than one window"):
        corpus.check_context(128)


def test_batches_are_a_function_of_seed_and_step(text_file: Path) -> None:
    split = load_corpus(DataConfig(path=str(text_file))).train
    a = train_batch(split, 4, 16, seed=1, step=7)
    assert a.shape == (4, 17) and a.dtype.is_floating_point is False
    assert np.array_equal(a.numpy(), train_batch(split, 4, 16, seed=1, step=7).numpy())
    assert not np.array_equal(a.numpy(), train_batch(split, 4, 16, seed=2, step=7).numpy())
    assert not np.array_equal(a.numpy(), train_batch(split, 4, 16, seed=1, step=8).numpy())
    starts = eval_starts(split, 10, 16)
    assert np.array_equal(starts, eval_starts(split, 10, 16)) and starts.max() <= len(split) - 17


def test_include_keeps_only_the_named_folders_and_eval_parts_hold_each_and_all(tmp_path: Path) -> None:
    """data.include: a node trains on some folders of a corpus (non-IID); data.eval_parts: the validation bytes
    of each named folder and of all of them, from the same by-file split as the whole corpus."""
    folder = tmp_path / "texts"
    for i in range(60):
        (folder / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (folder / f"d{i % 3}" / f"f{i}.txt").write_bytes(bytes([65 + i % 3]) * 1000)  # d0: A..., d1: B..., d2: C...
    config = DataConfig(path=str(folder), val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    whole = load_corpus(config)
    only = load_corpus(config.model_copy(update={"include": ["d1"]}))
    assert set(bytes(only.train)) == {66} and set(bytes(only.val)) == {66} and "only d1" in only.description
    both = load_corpus(config.model_copy(update={"include": ["d0", "d2/"]}))
    assert set(bytes(both.train)) == {65, 67} and len(both.train) + len(both.val) == 40 * 1000
    parts = load_parts(config.model_copy(update={"eval_parts": ["d0", "d1"]}), context=64)
    assert list(parts) == ["d0", "d1", "all"]
    assert set(bytes(parts["d0"])) == {65} and set(bytes(parts["all"])) == {65, 66}
    assert len(parts["all"]) == len(parts["d0"]) + len(parts["d1"])
    assert set(bytes(whole.val)) >= set(bytes(parts["all"]))  # the same files held out as in the whole corpus
    with pytest.raises(DataError, match="data.include names 'd9', which is not a folder inside"):
        load_corpus(config.model_copy(update={"include": ["d9"]}))
    with pytest.raises(DataError, match="data.include names '../texts'"):
        load_corpus(config.model_copy(update={"include": ["../texts"]}))
    with pytest.raises(DataError, match="fewer than one window of model.context"):
        load_parts(config.model_copy(update={"eval_parts": ["d0"]}), context=100_000)
    single = tmp_path / "one.txt"
    single.write_bytes(english_like(5000, seed=1))
    with pytest.raises(DataError, match="data.include names folders of a folder corpus"):
        load_corpus(DataConfig(path=str(single), include=["x"]))
