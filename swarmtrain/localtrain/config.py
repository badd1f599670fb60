"""The ``localtrain`` config section, the methods it can run, and how a model's blocks are cut into stages.

``LocalTrainConfig`` is defined with the other sections in ``swarmtrain.config`` (the section is ``localtrain``
of every config, read by ``swarmtrain localtrain bench`` and by a node with ``train.trainer = "localtrain"``).
Keys are set with ``--set localtrain.ring_depth=4``, ``SWARMTRAIN_LOCALTRAIN__RING_DEPTH=4`` or a
``[localtrain]`` table in the TOML file; ``swarmtrain localtrain bench --help`` shows the flags.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, get_args

from swarmtrain.config import Config, LocalTrainConfig, LocalTrainMethod, ModelConfig, load_config
from swarmtrain.localtrain.errors import LocalTrainError

METHODS: tuple[str, ...] = get_args(LocalTrainMethod)
ASYNC_METHODS = ("broadcast-async", "rgc-async")
SERIAL_METHODS = ("live-local", "broadcast-serial", "rgc-serial")


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


def check_node_config(config: Config) -> None:
    """The checks for ``train.trainer = "localtrain"`` (a swarm node's inner steps), as ``ValueError``s for the
    config's validator. Exits are parameters: a node's model must have the same parameter vector as every other
    node's, whatever their trainers, so the exits at the stage boundaries must be in ``model.exits`` itself."""
    lt, model = config.localtrain, config.model
    if config.train.precision != "fp32":
        raise ValueError(
            f"train.precision = {config.train.precision!r} is supported by the standard trainer only; localtrain "
            "computes in fp32: drop the setting or use train.trainer = 'standard'"
        )
    try:
        check_config(config, lt)
    except LocalTrainError as exc:
        raise ValueError(str(exc).removeprefix("config error: ").rstrip(".")) from None
    if lt.method in ASYNC_METHODS and lt.stages < 2:
        raise ValueError(
            f"localtrain.method = {lt.method!r} runs the upstream stages in their own processes and needs "
            "localtrain.stages >= 2; set localtrain.stages = 2 or choose a serial method"
        )
    if lt.method != "global-bp":
        needed = staged_model_config(model, lt.stages).exits
        if needed != sorted(set(model.exits)):
            raise ValueError(
                f"train.trainer = 'localtrain' with localtrain.stages = {lt.stages} needs an exit at every stage "
                f"boundary: set model.exits = {needed} on every node of the swarm (exits are parameters, so all "
                "nodes, standard trainers included, must use the same model.exits to average together)"
            )


def load_localtrain_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[Config, LocalTrainConfig]:
    """Resolve the config (``load_config``) and return it with its ``localtrain`` section.

    ``localtrain.*`` keys come from a ``[localtrain]`` table in the TOML file, ``SWARMTRAIN_LOCALTRAIN__*``
    variables, ``--set localtrain.KEY=VALUE`` and flags, in the usual order.
    """
    config = load_config(path, overrides, flags, environ)
    return config, config.localtrain
