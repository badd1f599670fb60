"""The serial local methods: every stage in one process, one after another, with all the run's threads.

- ``live-local``: deep supervision with detached stage inputs; every exit uses the live readout, whose gradient
  is the uniform average of all exits' gradients.
- ``broadcast-serial``: upstream stages use a readout snapshot ``serial_lag`` versions old and send nothing
  back; the readout learns from the last exit only.
- ``rgc-serial``: upstream stages differentiate against that snapshot and the owner averages their gradients
  with its own (``serial_lag = 0`` gives exactly ``live-local``).

They isolate what the async methods change (staleness, concurrency) from what local training changes.
"""

from __future__ import annotations

from collections import deque

import torch

from swarmtrain.config import Config
from swarmtrain.data import Corpus, train_batch
from swarmtrain.localtrain.config import SERIAL_METHODS, LocalTrainConfig
from swarmtrain.localtrain.errors import LocalTrainError
from swarmtrain.localtrain.rgc import ReadoutConsensus
from swarmtrain.localtrain.stage import Stage, build_full, build_stage_modules, local_loss
from swarmtrain.model import ByteTransformer


class SerialEngine:
    def __init__(self, config: Config, corpus: Corpus, lt: LocalTrainConfig, data_seed: int | None = None) -> None:
        if lt.method not in SERIAL_METHODS:
            raise LocalTrainError(f"config error: {lt.method} is not a serial method ({', '.join(SERIAL_METHODS)}).")
        self.config, self.corpus, self.lt = config, corpus, lt
        self.data_seed = config.train.seed if data_seed is None else data_seed
        self.full = build_full(config, lt.stages)
        self.stages = [Stage(m, config.train) for m in build_stage_modules(self.full, lt.stages)]
        self.readout = self.stages[-1].module.readout.weight
        self.lag = 0 if lt.method == "live-local" else lt.serial_lag
        # Snapshots of versions step - lag .. step; history[0] is what upstream stages see.
        self.history: deque[torch.Tensor] = deque([self.readout.detach().clone()], maxlen=self.lag + 1)
        self.consensus = ReadoutConsensus(lt.stages - 1)
        self.step = 0
        self.tokens = 0

    @property
    def snapshot_version(self) -> int:
        return max(0, self.step - self.lag)

    def train_step(self) -> float:
        """One step of every stage on the step's batch; returns the last exit's loss (nats per byte)."""
        t, context = self.config.train, self.config.model.context
        batch = train_batch(self.corpus.train, t.batch_size, context, self.data_seed, self.step)
        x, y = batch[:, :-1], batch[:, 1:]
        method, live = self.lt.method, self.readout
        snapshot = self.history[0]
        upstream_grads: list[torch.Tensor] = []
        h_in = x
        for stage in self.stages[:-1]:
            stage.module.train()
            h = stage.module(h_in)
            normed = stage.module.exit_norm(h)
            if method == "live-local":
                local_loss(normed, live, y).backward()  # accumulates into the live readout's gradient
            else:
                leaf = snapshot.clone().requires_grad_(method == "rgc-serial")
                local_loss(normed, leaf, y).backward()
                if leaf.grad is not None:
                    upstream_grads.append(leaf.grad)
            stage.apply()
            h_in = h.detach()
        owner = self.stages[-1]
        owner.module.train()
        loss = local_loss(owner.module.exit_norm(owner.module(h_in)), live, y)
        loss.backward()
        if method == "live-local":
            live.grad /= len(self.stages)  # the sum of every exit's readout gradient -> their uniform average
        elif method == "rgc-serial":
            lags = [self.step - self.snapshot_version] * len(upstream_grads)
            live.grad = self.consensus.combine(live.grad, upstream_grads, lags)
        owner.apply()
        self.history.append(live.detach().clone())
        self.step += 1
        self.tokens += batch.shape[0] * context
        return loss.item()

    def gathered_model(self) -> ByteTransformer:
        return self.full  # the stage modules share its tensors

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.full.load_state_dict(state)
        self.history = deque([self.readout.detach().clone()], maxlen=self.lag + 1)

    def breakdown(self) -> dict[str, object]:
        return {"readout": self.consensus.summary() if self.lt.method == "rgc-serial" else []}

    def close(self) -> None:
        return None
