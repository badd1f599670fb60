"""``LocalTrainer``: every method behind the shape of ``swarmtrain.train.Trainer``, so a node can drive it.

``train_step()`` returns the last exit's training loss, ``step`` and ``tokens`` count as the ``Trainer``'s do,
``model`` is the whole ``ByteTransformer`` with the stages' parameters gathered back into it, ``evaluate()``
gives held-out bits per byte on the same windows as ``Trainer.evaluate``. A node running DiLoCo inner steps
calls ``set_horizon(step + H)`` at the start of a round so the async pipeline drains at its end, reads
``model`` (or ``state()``), and writes the averaged parameters back with ``load_model_state``. Always
``close()`` it (or use it as a context manager): the async methods hold processes and shared memory.

    with LocalTrainer(config, corpus, LocalTrainConfig(method="rgc-async", stages=2)) as trainer:
        for _ in range(100):
            trainer.train_step()
        print(trainer.evaluate())
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from swarmtrain.config import Config
from swarmtrain.data import Corpus, train_batch
from swarmtrain.localtrain.config import ASYNC_METHODS, LocalTrainConfig, check_config, total_threads
from swarmtrain.localtrain.pipeline import PipelineEngine
from swarmtrain.localtrain.serial import SerialEngine
from swarmtrain.localtrain.stage import Stage, StageModule, ThreadState, local_loss, setup_threads
from swarmtrain.model import ByteTransformer
from swarmtrain.train.trainer import evaluate_bpb


class Engine(Protocol):
    step: int
    tokens: int

    def train_step(self) -> float: ...
    def gathered_model(self) -> ByteTransformer: ...
    def load_model_state(self, state: dict[str, torch.Tensor]) -> None: ...
    def breakdown(self) -> dict[str, object]: ...
    def close(self) -> None: ...


class GlobalEngine:
    """Global backprop: one stage that holds the whole model, trained on the last exit with all the threads.

    The same arithmetic as ``swarmtrain.train.Trainer`` (tests compare the two), but with this package's AdamW,
    so that the benchmark's reference pays the same per-process memory as every stage.
    """

    def __init__(self, config: Config, corpus: Corpus, lt: LocalTrainConfig, data_seed: int | None = None) -> None:
        setup_threads(total_threads(lt))
        self.config, self.corpus = config, corpus
        self.data_seed = config.train.seed if data_seed is None else data_seed
        torch.manual_seed(config.train.seed)
        self.full = ByteTransformer(config.model)
        self.stage = Stage(StageModule(self.full, 0, config.model.depth, owner=True), config.train)
        self.step = 0
        self.tokens = 0

    def train_step(self) -> float:
        t, context = self.config.train, self.config.model.context
        batch = train_batch(self.corpus.train, t.batch_size, context, self.data_seed, self.step)
        module = self.stage.module
        module.train()
        loss = local_loss(module.exit_norm(module(batch[:, :-1])), module.readout.weight, batch[:, 1:])
        loss.backward()
        self.stage.apply()
        self.step += 1
        self.tokens += batch.shape[0] * context
        return loss.item()

    def gathered_model(self) -> ByteTransformer:
        return self.full

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.full.load_state_dict(state, strict=False)

    def breakdown(self) -> dict[str, object]:
        return {}

    def close(self) -> None:
        return None


class LocalTrainer:
    def __init__(
        self,
        config: Config,
        corpus: Corpus,
        lt: LocalTrainConfig | None = None,
        prefix: str | None = None,
        horizon: int | None = None,
        data_seed: int | None = None,
    ) -> None:
        """``prefix`` names the shared-memory segments; ``horizon`` is the first drain point (train.max_steps);
        ``data_seed`` picks the training windows (train.seed if unset; a node passes its own, like ``Trainer``).
        ``lt`` defaults to the config's ``localtrain`` section."""
        lt = lt or config.localtrain
        corpus.check_context(config.model.context)
        check_config(config, lt)
        self.config, self.corpus, self.lt = config, corpus, lt
        self.engine: Engine
        # This process runs the owner stage (or all of them) with localtrain's threads and cores; close() puts
        # the caller's own back.
        self._caller: ThreadState | None = ThreadState.current()
        try:
            if lt.method == "global-bp":
                self.engine = GlobalEngine(config, corpus, lt, data_seed=data_seed)
            elif lt.method in ASYNC_METHODS:
                self.engine = PipelineEngine(config, corpus, lt, prefix=prefix, horizon=horizon, data_seed=data_seed)
            else:
                setup_threads(total_threads(lt))
                self.engine = SerialEngine(config, corpus, lt, data_seed=data_seed)
        except BaseException:
            self._restore_caller()
            raise

    def _restore_caller(self) -> None:
        if self._caller is not None:
            self._caller.restore()
            self._caller = None

    @property
    def step(self) -> int:
        return self.engine.step

    @property
    def tokens(self) -> int:
        return self.engine.tokens

    def train_step(self) -> float:
        """One step of every stage; returns the last exit's training loss in nats per byte."""
        return self.engine.train_step()

    @property
    def segment_prefix(self) -> str | None:
        """The name prefix of this run's shared-memory segments (``/dev/shm/<prefix>-*``); None without any."""
        return self.engine.prefix if isinstance(self.engine, PipelineEngine) else None

    def set_horizon(self, steps: int) -> None:
        """Let async stages run up to step ``steps``; the pipeline drains there (a no-op for other methods)."""
        if isinstance(self.engine, PipelineEngine):
            self.engine.set_horizon(steps)

    @property
    def model(self) -> ByteTransformer:
        """The whole model with every stage's current parameters (async: needs a drained pipeline)."""
        return self.engine.gathered_model()

    def evaluate(self, val: np.ndarray | None = None) -> float:
        return evaluate_bpb(self.model, self.corpus.val if val is None else val, self.config)

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Model tensors (named as ``Trainer.state`` names them) and metadata; optimizer states stay in the stages."""
        tensors = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        meta = {"step": self.step, "tokens": self.tokens, "method": self.lt.method, "config": self.config.model_dump()}
        return tensors, meta

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Overwrite the model's parameters (e.g. after an outer step); optimizer states are kept."""
        self.engine.load_model_state(state)

    def breakdown(self) -> dict[str, object]:
        """Per-stage busy, waiting and communication seconds, lag, and readout-gradient cosines."""
        return self.engine.breakdown()

    def close(self, abort: bool = False) -> None:
        """Release the stages (async: stop or abort their processes, then unlink every shared segment) and give
        this process back the thread count and CPU affinity it had before."""
        try:
            if isinstance(self.engine, PipelineEngine):
                self.engine.close(abort=abort)
            else:
                self.engine.close()
        finally:
            self._restore_caller()

    def __enter__(self) -> LocalTrainer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(abort=exc_type is not None)
