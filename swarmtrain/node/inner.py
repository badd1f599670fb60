"""A node's inner steps behind one small interface, whichever trainer runs them (``train.trainer``).

- ``standard``: ``swarmtrain.train.Trainer`` in the node's process (global backprop, ``train.threads``).
- ``localtrain``: ``swarmtrain.localtrain.LocalTrainer`` with the ``localtrain`` section (method, stages,
  threads); the async methods run the upstream stages in their own processes over shared memory.

The node only moves flat parameter vectors in and out (``vector``, ``load_vector``), in the order of
``ByteTransformer(config.model).parameters()``: both trainers hold the same parameters when their model configs
match (the config check makes localtrain's stage-boundary exits part of ``model.exits``), so nodes with either
trainer average together. Those vectors are fp32 on the CPU whatever ``train.device`` the standard trainer
computes on: the parameters cross between device and CPU twice a round (in after the outer step, out before it),
and everything the swarm agrees on stays on the CPU. ``run`` executes one round's H steps, or the steps that fit
in ``node.inner_time_s`` (in a worker thread); ``stop`` makes a running
``run`` return after its current step and waits for it, so Ctrl+C or an error never tears resources down under
a running step; ``close`` stops and then releases the stage processes and shared memory.

``node.overlap``: ``merge`` mixes a new theta_g into a run in flight, between two of its steps, keeping a share
of the parameters as they are then (``node.overlap_keep``); ``evaluate_theta`` measures theta_g on a copy of the
model while the steps go on.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from swarmtrain.config import Config
from swarmtrain.data import Corpus
from swarmtrain.model import ByteTransformer
from swarmtrain.train import Checkpoint, Trainer, check_compatible
from swarmtrain.train.trainer import evaluate_bpb

log = logging.getLogger(__name__)


class InnerLoop(ABC):
    """The shared part: every use of the trainer holds one lock, so ``stop`` (from another thread) waits for a
    step, gather or evaluation in flight, and a stopped loop runs no further step."""

    shapes: list[tuple[int, ...]]
    """Shape of each parameter, in the order of the flat vector."""
    device: str = "cpu"
    """Where the inner steps compute (``cpu``, ``cuda:0``, ``mps``)."""

    def __init__(self, config: Config, val: np.ndarray) -> None:
        self.config, self.val = config, val  # the model's settings and the held-out bytes (evaluate_theta)
        self._copy: ByteTransformer | None = None  # evaluate_theta's model, made at its first use
        self._stopping = threading.Event()
        self._busy = threading.Lock()
        self._merge: tuple[torch.Tensor, float] | None = None  # (theta_g, keep) for the next step
        self._merge_lock = threading.Lock()

    @property
    @abstractmethod
    def tokens(self) -> int:
        """Tokens trained on so far."""

    def run(
        self, steps: int, time_s: float = 0.0, step_delay_s: float = 0.0, slowdown: float = 1.0
    ) -> tuple[float, int, float]:
        """``steps`` inner steps, or with ``time_s`` > 0 as many as start within ``time_s`` seconds (at least
        one), fewer if stopped; returns the mean loss, the tokens and the seconds they took. A slower machine on
        this one: ``slowdown`` makes each step take that many times as long (``node.slowdown``), and
        ``step_delay_s`` sleeps after each step (``node.test_step_delay_s``: a fixed delay, for tests)."""
        with self._busy:
            started, tokens0, losses = time.perf_counter(), self.tokens, []
            if not self._stopping.is_set():
                self._begin(steps)
            while time_s > 0 or len(losses) < steps:
                if self._stopping.is_set() or (losses and time_s > 0 and time.perf_counter() - started >= time_s):
                    break
                self._apply_merge()
                step_started = time.perf_counter()
                losses.append(self._step())
                delay = step_delay_s + (slowdown - 1) * (time.perf_counter() - step_started)
                if delay > 0:
                    time.sleep(delay)
            self._apply_merge()  # theta_g that came during the last step
            loss = sum(losses) / len(losses) if losses else float("nan")
            return loss, self.tokens - tokens0, time.perf_counter() - started

    def vector(self) -> torch.Tensor:
        """The model's parameters as one flat float32 vector (a copy)."""
        with self._busy:
            self._apply_merge()
            return self._vector()

    def load_vector(self, theta: torch.Tensor) -> None:
        """Overwrite the model's parameters with ``theta`` (the optimizer states are kept)."""
        with self._busy:
            with self._merge_lock:
                self._merge = None
            self._load_vector(theta)

    def merge(self, theta: torch.Tensor, keep: float) -> None:
        """Make the parameters ``keep * x + (1 - keep) * theta``, x being the parameters then (Streaming DiLoCo's
        merge of a theta_g that arrives while the steps go on). Returns at once: a run in flight applies it before
        its next step (or as it ends), else the next use of the model."""
        with self._merge_lock:
            self._merge = (theta.detach().clone(), keep)

    def evaluate_theta(self, theta: torch.Tensor) -> float:
        """Held-out bits per byte of ``theta`` on a copy of the model (on the trainer's device), without waiting
        for a run in flight. Both trainers' parameters are ``ByteTransformer(config.model)``'s."""
        if self._copy is None:
            self._copy = ByteTransformer(self.config.model).to(self.device)
        with torch.no_grad():
            vector_to_parameters(theta.detach().to(self.device, torch.float32, copy=True), self._copy.parameters())
        return evaluate_bpb(self._copy, self.val, self.config, torch.device(self.device))

    def _apply_merge(self) -> None:  # holding ``_busy``
        with self._merge_lock:
            pending, self._merge = self._merge, None
        if pending is not None:
            theta, keep = pending
            self._load_vector(self._vector().lerp_(theta, 1.0 - keep))  # keep x + (1 - keep) theta, in the copy

    def evaluate(self, val: np.ndarray | None = None) -> float:
        """Held-out bits per byte of the current model (on the validation bytes ``val``, else its corpus's)."""
        with self._busy:
            self._apply_merge()
            return self._evaluate(val)

    def interrupt(self) -> None:
        """Make a running ``run`` return after its current step, without waiting (safe from any thread)."""
        self._stopping.set()

    def stop(self) -> None:
        """Make a running ``run`` return after its current step and wait for whatever is in flight."""
        self._stopping.set()
        with self._busy:
            pass

    def close(self) -> None:
        """Stop, then release whatever the trainer holds; safe to call twice."""
        self.stop()

    @abstractmethod
    def state(self, theta_g: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Tensors and metadata for a checkpoint (``theta_g``: the last parameters the swarm agreed on); call it
        between rounds or after ``stop``."""

    @abstractmethod
    def restore(self, checkpoint: Checkpoint) -> None:
        """Continue from a node checkpoint: what ``state`` saved of this trainer (the node then loads theta_g);
        a checkpoint of another model shape raises ``CheckpointError``. Call it before the first round."""

    def _begin(self, steps: int) -> None:
        """Called at the start of a round of ``steps`` steps (the standard trainer needs nothing)."""
        return None

    @abstractmethod
    def _step(self) -> float: ...

    @abstractmethod
    def _vector(self) -> torch.Tensor: ...

    @abstractmethod
    def _load_vector(self, theta: torch.Tensor) -> None: ...

    @abstractmethod
    def _evaluate(self, val: np.ndarray | None) -> float: ...


class StandardLoop(InnerLoop):
    def __init__(self, config: Config, corpus: Corpus, data_seed: int) -> None:
        super().__init__(config, corpus.val)
        self.trainer = Trainer(config, corpus, data_seed=data_seed)
        self.shapes = [tuple(p.shape) for p in self.trainer.model.parameters()]
        self.device = str(self.trainer.device)
        log.info("inner steps by the standard trainer on %s", self.device)

    @property
    def tokens(self) -> int:
        return self.trainer.tokens

    def _step(self) -> float:
        return self.trainer.train_step()

    def _vector(self) -> torch.Tensor:
        # One flat copy on the device, then one transfer: theta_g and the outer step stay on the CPU in fp32.
        return parameters_to_vector(self.trainer.model.parameters()).detach().to("cpu", torch.float32, copy=True)

    def _load_vector(self, theta: torch.Tensor) -> None:
        with torch.no_grad():  # a copy on the device: the parameters become views of it
            on_device = theta.detach().to(self.trainer.device, torch.float32, copy=True)
            vector_to_parameters(on_device, self.trainer.model.parameters())

    def _evaluate(self, val: np.ndarray | None) -> float:
        return self.trainer.evaluate(val)

    def state(self, theta_g: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.trainer.state()  # the local model and AdamW: what `swarmtrain train` resumes from

    def restore(self, checkpoint: Checkpoint) -> None:
        with self._busy:
            if "optimizer_groups" in checkpoint.meta:
                self.trainer.load_state(checkpoint)  # model, AdamW, step (the data position and lr schedule)
            else:  # written by a localtrain node: theta_g only, a fresh AdamW
                check_compatible(checkpoint, self.trainer.config)
                self.trainer.step, self.trainer.tokens = int(checkpoint.meta["step"]), int(checkpoint.meta["tokens"])


class LocalTrainLoop(InnerLoop):
    """``LocalTrainer`` for the inner steps. The async pipeline starts drained (horizon 0); each round moves the
    horizon H steps on, so it drains at the round's end and the parameters can be gathered and loaded."""

    def __init__(self, config: Config, corpus: Corpus, data_seed: int) -> None:
        from swarmtrain.localtrain import LocalTrainer

        super().__init__(config, corpus.val)
        self.trainer = LocalTrainer(config, corpus, config.localtrain, horizon=0, data_seed=data_seed)
        try:
            named = list(self.trainer.model.named_parameters())  # the pipeline is drained at step 0
        except BaseException:
            self.trainer.close(abort=True)
            raise
        self.layout = [(name, p.shape) for name, p in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.sizes = [p.numel() for _, p in named]
        lt = config.localtrain
        prefix = self.trainer.segment_prefix
        threads = f"threads per stage {lt.stage_threads}" if lt.stage_threads else f"{lt.threads or 'all'} threads"
        log.info(
            "inner steps by localtrain: %s in %d stages, %s%s", lt.method, lt.stages, threads,
            f", shared memory /dev/shm/{prefix}-*" if prefix else "",
        )  # fmt: skip
        self._closed = False
        self.resumed_at = (0, 0)  # step and tokens of the checkpoint resumed from: checkpoints count on from there

    @property
    def tokens(self) -> int:
        return self.trainer.tokens

    def _begin(self, steps: int) -> None:
        self.trainer.set_horizon(self.trainer.step + steps)

    def _step(self) -> float:
        return self.trainer.train_step()

    def _vector(self) -> torch.Tensor:
        return parameters_to_vector(self.trainer.model.parameters()).detach()

    def _load_vector(self, theta: torch.Tensor) -> None:
        parts = theta.detach().split(self.sizes)
        state = {name: part.view(shape) for (name, shape), part in zip(self.layout, parts, strict=True)}
        self.trainer.load_model_state(state)

    def _evaluate(self, val: np.ndarray | None) -> float:
        return self.trainer.evaluate(val)

    def state(self, theta_g: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        # theta_g, not the stages' parameters: after a round they are equal, and in the middle of one (Ctrl+C)
        # the pipeline is not drained and cannot be gathered. The stages keep their AdamW states to themselves.
        parts = theta_g.detach().split(self.sizes)
        tensors = {f"model.{name}": part.view(shape) for (name, shape), part in zip(self.layout, parts, strict=True)}
        meta = {
            "step": self.resumed_at[0] + self.trainer.step,
            "tokens": self.resumed_at[1] + self.trainer.tokens,
            "trainer": "localtrain",
            "method": self.config.localtrain.method,
            "model_is": "theta_g",
            "config": self.config.model_dump(),
        }
        return tensors, meta

    def restore(self, checkpoint: Checkpoint) -> None:
        # The stages' AdamW states were not saved, and the pipeline's data position restarts at 0.
        check_compatible(checkpoint, self.config)
        self.resumed_at = (int(checkpoint.meta["step"]), int(checkpoint.meta["tokens"]))

    def close(self) -> None:
        self.stop()
        if not self._closed:
            self._closed = True
            self.trainer.close()


def build_inner_loop(config: Config, corpus: Corpus, data_seed: int) -> InnerLoop:
    """The inner loop ``train.trainer`` selects; ``close()`` it on every exit path."""
    if config.train.trainer == "localtrain":
        return LocalTrainLoop(config, corpus, data_seed)
    return StandardLoop(config, corpus, data_seed)
