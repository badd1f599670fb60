"""Byte corpora: a text file, a folder of text files, enwik8, or the Python standard library's source tree.

Every corpus ends as two memory-mapped uint8 arrays (train and validation), so any number of workers read
the same pages without a private copy. A single file is mapped directly (its tail is the validation split;
enwik8 gets the standard 90M/5M/5M split). A folder is packed once into a cache file, whole files assigned
to validation by a hash of their relative path, so the split never changes for the same files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from swarmtrain.config import DataConfig
from swarmtrain.errors import DataError
from swarmtrain.fsutil import atomic_write, atomic_write_bytes

log = logging.getLogger(__name__)

ENWIK8_SIZE = 100_000_000
_SNIFF_BYTES = 1 << 16
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git", ".hg", ".svn", "node_modules"}


@dataclass(frozen=True)
class Corpus:
    """Train and validation bytes (read-only, usually memory-mapped) and where they came from."""

    train: np.ndarray
    val: np.ndarray
    description: str

    def check_context(self, context: int) -> None:
        """Raise a ``DataError`` unless both splits hold at least one window of ``context + 1`` bytes."""
        total = len(self.train) + len(self.val)
        for name, split in (("training", self.train), ("validation", self.val)):
            if len(split) < context + 1:
                # A fix must suit both splits: the longest context that fits the shorter one (the minimum is 2),
                # or a corpus large enough that, split the same way, each holds a window.
                fits = min(len(self.train), len(self.val)) - 1
                fixes = [f"a shorter context (--set model.context={fits})"] if fits >= 2 else []
                share = math.ceil((context + 1) / total * 100) / 100
                if name == "validation" and share < 0.5:
                    fixes.append(f"a larger held-out share (--set data.val_fraction={share})")
                smaller = max(min(len(self.train), len(self.val)), 1)
                fixes.append(f"a larger corpus (about {math.ceil((context + 1) * total / smaller):,} bytes or more)")
                raise DataError(
                    f"data error: the {name} split of {self.description} has {len(split)} bytes, fewer than one "
                    f"window of model.context + 1 = {context + 1} bytes. Use " + ", or ".join(fixes) + "."
                )


def stdlib_root() -> Path:
    """The source tree of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def looks_like_text(sample: bytes) -> bool:
    """True if ``sample`` has no NUL bytes and decodes as UTF-8 (a cut multi-byte character at the end is fine)."""
    if b"\x00" in sample:
        return False
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start >= len(sample) - 3
    return True


def _sniff(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(_SNIFF_BYTES)


def load_corpus(config: DataConfig) -> Corpus:
    """Open the corpus that ``config`` names; raise a ``DataError`` that names the fix if it cannot be used."""
    if config.path is None:
        return _load_folder(stdlib_root(), config, suffixes=(".py",), label="Python standard library source")
    path = Path(config.path).expanduser()
    if not path.exists():
        raise DataError(
            f"data error: corpus path {path} does not exist. Pass --data with a text file or a folder of text "
            "files, or leave --data unset to train on the Python standard library source."
        )
    if path.is_dir():
        return _load_folder(path, config, suffixes=None, label=str(path))
    if config.include:
        raise DataError(
            f"data error: data.include names folders of a folder corpus, and {path} is a file. Point --data at a "
            "folder, or drop data.include."
        )
    return _load_file(path, config)


def load_parts(config: DataConfig, context: int) -> dict[str, np.ndarray]:
    """The validation bytes of each folder in ``data.eval_parts`` and of all of them together (under "all")."""
    if not config.eval_parts:
        return {}
    parts = {part: load_corpus(config.model_copy(update={"include": [part]})).val for part in config.eval_parts}
    parts["all"] = load_corpus(config.model_copy(update={"include": config.eval_parts})).val
    for part, val in parts.items():
        if len(val) < context + 1:
            raise DataError(
                f"data error: the validation split of data.eval_parts {part!r} has {len(val)} bytes, fewer than one "
                f"window of model.context + 1 = {context + 1} bytes. Name a larger folder in data.eval_parts."
            )
    return parts


def _load_file(path: Path, config: DataConfig) -> Corpus:
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"data error: corpus file {path} is empty. Point --data at a file with text in it.")
    if not looks_like_text(_sniff(path)):
        raise DataError(
            f"data error: {path} does not look like text (it has NUL bytes or is not UTF-8). swarmtrain trains "
            "on text: pass a text file or a folder of text files with --data."
        )
    data = np.memmap(path, dtype=np.uint8, mode="r")
    if path.name.startswith("enwik8") and size == ENWIK8_SIZE:
        # The standard split: 90M train, 5M validation, 5M test (unused here).
        return Corpus(data[:90_000_000], data[90_000_000:95_000_000], f"enwik8 ({path})")
    cut = size - max(1, int(size * config.val_fraction))
    return Corpus(data[:cut], data[cut:], str(path))


def _list_files(root: Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith(".") or (suffixes is not None and not name.endswith(suffixes)):
                continue
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                files.append(path)
    return files


def _load_folder(root: Path, config: DataConfig, suffixes: tuple[str, ...] | None, label: str) -> Corpus:
    files = _list_files(root, suffixes)
    if config.include:
        for folder in config.include:
            if not (root / folder).is_dir() or Path(folder).is_absolute() or ".." in Path(folder).parts:
                raise DataError(
                    f"data error: data.include names {folder!r}, which is not a folder inside {label} ({root}). "
                    'Name folders relative to the corpus, such as "email".'
                )
        wanted = tuple(Path(folder).as_posix().rstrip("/") + "/" for folder in config.include)
        files = [f for f in files if f.relative_to(root).as_posix().startswith(wanted)]
        label = f"{label}, only {', '.join(config.include)}"
    stats = [(f.relative_to(root).as_posix(), f.stat()) for f in files]
    key = hashlib.sha256(
        json.dumps([str(root), config.val_fraction, [(r, s.st_size, s.st_mtime_ns) for r, s in stats]]).encode()
    ).hexdigest()[:20]
    cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else Path.home() / ".cache" / "swarmtrain"
    blob, meta_path = cache_dir / f"corpus-{key}.bin", cache_dir / f"corpus-{key}.json"
    if not (blob.exists() and meta_path.exists()):
        _pack_folder(root, [r for r, _ in stats], config.val_fraction, blob, meta_path, label)
    meta = json.loads(meta_path.read_text())
    data = np.memmap(blob, dtype=np.uint8, mode="r")
    cut = meta["train_bytes"]
    return Corpus(data[:cut], data[cut:], f"{label} ({meta['files']} files, {len(data) / 1e6:.1f} MB)")


def _is_validation(relpath: str, val_fraction: float) -> bool:
    return zlib.crc32(relpath.encode()) % 10_000 < val_fraction * 10_000


def _pack_folder(
    root: Path, relpaths: list[str], val_fraction: float, blob: Path, meta_path: Path, label: str
) -> None:
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    for rel in relpaths:
        try:
            content = (root / rel).read_bytes()
        except OSError:
            continue
        if not content or not looks_like_text(content[:_SNIFF_BYTES]):
            continue
        (val_parts if _is_validation(rel, val_fraction) else train_parts).append(content)
    files = len(train_parts) + len(val_parts)
    if files == 0:
        raise DataError(
            f"data error: found no non-empty text files in {label}. Point --data at a text file or a folder that "
            "holds text files (binary files are skipped)."
        )
    train, val = b"".join(train_parts), b"".join(val_parts)
    if not train or not val:
        # Too few files to split by file: fall back to the tail of the packed stream.
        joined = train + val
        cut = len(joined) - max(1, int(len(joined) * val_fraction))
        train, val = joined[:cut], joined[cut:]
    log.info("packing %d files of %s into %s", files, label, blob)
    atomic_write(blob, lambda tmp: tmp.write_bytes(train + val))
    atomic_write_bytes(meta_path, json.dumps({"train_bytes": len(train), "files": files}).encode())
