"""The ``localtrain`` config section, the methods it can run, and how a model's blocks are cut into stages.

Keys are set with ``--set localtrain.ring_depth=4``, ``SWARMTRAIN_LOCALTRAIN__RING_DEPTH=4`` or a
``[localtrain]`` table in the TOML file; ``swarmtrain localtrain bench --help`` shows the flags.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarmtrain.config import ENV_PREFIX, Config, ModelConfig, load_config, parse_value
from swarmtrain.errors import ConfigError
from swarmtrain.localtrain.errors import LocalTrainError

Method = Literal["global-bp", "live-local", "broadcast-serial", "broadcast-async", "rgc-serial", "rgc-async"]
METHODS: tuple[str, ...] = (
    "global-bp",
    "live-local",
    "broadcast-serial",
    "broadcast-async",
    "rgc-serial",
    "rgc-async",
)
ASYNC_METHODS = ("broadcast-async", "rgc-async")
SERIAL_METHODS = ("live-local", "broadcast-serial", "rgc-serial")


class LocalTrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    method: Method = "rgc-async"
    """How the stages share the readout: global-bp, live-local, broadcast-serial/-async or rgc-serial/-async."""
    stages: int = Field(2, ge=1, le=64)
    """Stages the model's blocks are cut into (one process each for the async methods)."""
    threads: int = Field(0, ge=0)
    """Total torch threads over all stages (global backprop gets all of them); 0 means all cores."""
    stage_threads: list[int] = Field(default_factory=list)
    """Threads per stage, first to last; empty splits localtrain.threads evenly (the remainder to early stages)."""
    pin_cores: bool = False
    """Pin each stage process to its own cores (off by default: on a shared machine pinning can hurt)."""
    ring_depth: int = Field(2, ge=1, le=64)
    """Slots per ring; also the most readout versions an upstream stage may lag behind (per stage of distance)."""
    serial_lag: int = Field(1, ge=0)
    """Readout-snapshot lag in steps for broadcast-serial and rgc-serial (0 makes rgc-serial equal live-local)."""
    wait_timeout: float = Field(120.0, gt=0.0)
    """Seconds any wait on a ring, snapshot or stage may last before the run fails."""
    start_timeout: float = Field(180.0, gt=0.0)
    """Seconds the stage processes may take to start (import torch, build their part of the model)."""


def available_cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def thread_env(threads: int) -> Iterator[None]:
    """Children started inside see their thread count in the environment from the start (before torch
    creates its pools)."""
    saved = {k: os.environ.get(k) for k in _THREAD_ENV}
    os.environ.update({k: str(threads) for k in _THREAD_ENV})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def total_threads(lt: LocalTrainConfig) -> int:
    """The thread budget: localtrain.threads, or every core this process may run on."""
    return lt.threads or len(available_cores())


def split_threads(lt: LocalTrainConfig) -> list[int]:
    """Threads of each stage: ``stage_threads`` if given, else the total split evenly (at least one each)."""
    if lt.stage_threads:
        if len(lt.stage_threads) != lt.stages or min(lt.stage_threads) < 1:
            raise LocalTrainError(
                f"config error: localtrain.stage_threads {lt.stage_threads} must hold localtrain.stages "
                f"({lt.stages}) counts of at least 1."
            )
        return list(lt.stage_threads)
    total = max(total_threads(lt), lt.stages)
    base, extra = divmod(total, lt.stages)
    return [base + (1 if i < extra else 0) for i in range(lt.stages)]


def stage_cores(lt: LocalTrainConfig, threads: list[int]) -> list[list[int]]:
    """Cores of each stage when pinning: consecutive runs of the allowed cores (wrapping if too few)."""
    allowed = available_cores()
    cores, offset = [], 0
    for count in threads:
        cores.append([allowed[(offset + i) % len(allowed)] for i in range(count)])
        offset += count
    return cores


def stage_bounds(depth: int, stages: int) -> list[tuple[int, int]]:
    """Block ranges ``[start, end)`` of each stage; earlier stages take the remainder (the owner does extra work)."""
    if not 1 <= stages <= depth:
        raise LocalTrainError(
            f"config error: localtrain.stages ({stages}) must lie between 1 and model.depth ({depth}). "
            "Use fewer stages or a deeper model."
        )
    base, extra = divmod(depth, stages)
    bounds, start = [], 0
    for i in range(stages):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def staged_model_config(model: ModelConfig, stages: int) -> ModelConfig:
    """The model config with an exit at every stage boundary (same initial weights: exits add only norms)."""
    if not model.shared_readout:
        raise LocalTrainError(
            "config error: localtrain needs model.shared_readout = true (the stages share one readout). "
            "Remove --set model.shared_readout=false."
        )
    ends = [end for _, end in stage_bounds(model.depth, stages)[:-1]]
    return model.model_copy(update={"exits": sorted(set(model.exits) | set(ends))})


def check_config(config: Config, lt: LocalTrainConfig) -> None:
    """Cross-section checks, raised as one clear error before any process starts."""
    if lt.method != "global-bp":
        staged_model_config(config.model, lt.stages)
        split_threads(lt)


LOCALTRAIN_ENV_PREFIX = "SWARMTRAIN_LOCALTRAIN__"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            items.extend(_flatten(value, f"{prefix}{key}."))
        else:
            items.append((f"{prefix}{key}", value))
    return items


def _explain_localtrain(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        key = "localtrain." + ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":
            close = difflib.get_close_matches(key, [f"localtrain.{k}" for k in LocalTrainConfig.model_fields], n=1)
            lines.append(f"{key} is not a known setting." + (f" Did you mean {close[0]}?" if close else ""))
        else:
            lines.append(f"{key} = {item.get('input')!r} is invalid: {item['msg']}.")
    return "config error: " + " ".join(lines) + " See `swarmtrain localtrain bench --help` for the settings."


def load_localtrain_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[Config, LocalTrainConfig]:
    """Resolve the usual config plus the ``localtrain`` section, from the same sources in the same order.

    ``localtrain.*`` keys may come from a ``[localtrain]`` table in the TOML file, ``SWARMTRAIN_LOCALTRAIN__*``
    variables, ``--set localtrain.KEY=VALUE`` and flags; everything else goes through ``load_config``.
    """
    environ = dict(os.environ if environ is None else environ)
    section: dict[str, Any] = {}
    base_overrides: list[str] = []
    file_path: str | Path | None = path
    if path is not None:
        try:
            tree = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError):
            tree = {}  # load_config reports the problem with its usual message
        if isinstance(tree.get("localtrain"), dict):
            section.update(tree.pop("localtrain"))
            # load_config would reject the table: pass the rest on as the lowest-precedence overrides, and the
            # environment after it, so the precedence file < environment < --set < flags still holds.
            base_overrides = [f"{k}={_toml_value(v)}" for k, v in _flatten(tree)]
            for name in sorted(environ):
                if name.startswith(ENV_PREFIX) and not name.startswith(LOCALTRAIN_ENV_PREFIX):
                    key = name[len(ENV_PREFIX) :].lower().replace("__", ".")
                    base_overrides.append(f"{key}={environ.pop(name)}")
            file_path = None
    for name in sorted(environ):
        if name.startswith(LOCALTRAIN_ENV_PREFIX):
            section[name[len(LOCALTRAIN_ENV_PREFIX) :].lower()] = parse_value(environ.pop(name))
    rest: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.strip().startswith("localtrain."):
            section[key.strip().removeprefix("localtrain.")] = parse_value(value.strip())
        else:
            rest.append(item)
    other_flags: dict[str, Any] = {}
    for key, value in (flags or {}).items():
        if key.startswith("localtrain."):
            if value is not None:
                section[key.removeprefix("localtrain.")] = value
        else:
            other_flags[key] = value
    config = load_config(file_path, [*base_overrides, *rest], other_flags, environ)
    try:
        lt = LocalTrainConfig.model_validate(section)
    except ValidationError as exc:
        raise ConfigError(_explain_localtrain(exc)) from None
    return config, lt
