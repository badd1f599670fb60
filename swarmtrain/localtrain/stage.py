"""One stage's part of the byte transformer, its optimizer, and the local loss through its exit.

Every stage builds the whole ``ByteTransformer`` from the run's seed (so all methods start from the same weights
as global backprop) and keeps only its blocks: the embeddings for the first stage, the exit norm at its end
boundary, and for the last stage (the owner) the shared readout. A stage trains on the cross-entropy of its own
exit with its own AdamW and its own gradient clipping; its input arrives detached, so no gradient crosses a
stage boundary.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.config import Config, TrainConfig
from swarmtrain.localtrain.config import stage_bounds, staged_model_config
from swarmtrain.localtrain.optim import AdamW, clip_grad_norm
from swarmtrain.model import VOCAB, ByteTransformer, param_groups


def setup_threads(threads: int, cores: list[int] | None = None) -> None:
    """Thread budget and affinity of this process; call before its first torch op."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # the inter-op pool already started (torch ran ops in this process before)
        pass


@dataclass(frozen=True)
class ThreadState:
    """A process's torch thread count and CPU affinity: what localtrain puts back when it closes, so the
    process that ran it (a node, a test, a notebook) keeps its own budget."""

    threads: int
    cores: frozenset[int] | None

    @classmethod
    def current(cls) -> ThreadState:
        cores = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return cls(torch.get_num_threads(), cores)

    def restore(self) -> None:
        if self.cores is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cores)
        torch.set_num_threads(self.threads)


def lr_at(train: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to ``lr * min_lr_ratio`` (the schedule of ``swarmtrain.train.Trainer``)."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    progress = min(1.0, (step - train.warmup_steps) / max(1, train.max_steps - train.warmup_steps))
    return train.lr * (train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def local_loss(normed: torch.Tensor, readout: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats per byte) of the readout matrix applied to exit-normed hidden states."""
    return F.cross_entropy(F.linear(normed, readout).reshape(-1, VOCAB), targets.reshape(-1))


class StageModule(nn.Module):
    """Blocks ``[start, end)`` of a ``ByteTransformer`` (sharing its tensors), with the exit at ``end``."""

    def __init__(self, full: ByteTransformer, start: int, end: int, owner: bool) -> None:
        super().__init__()
        self.start, self.end, self.depth = start, end, full.config.depth
        self.first, self.owner = start == 0, owner
        if self.first:
            self.embed = full.embed
            self.pos = full.pos
        self.blocks = nn.ModuleList(full.blocks[start:end])
        self.exit_norm = full.exit_norms[str(end)]
        if owner:
            self.readout = full.readout_for(end)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states after this stage's blocks; ``x`` is a byte tensor for the first stage, else hidden states."""
        if self.first:
            x = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return x

    def full_name(self, name: str) -> str:
        """The name of one of this module's parameters in the whole ``ByteTransformer``."""
        head, _, rest = name.partition(".")
        if head == "blocks":
            index, _, rest = rest.partition(".")
            return f"blocks.{self.start + int(index)}.{rest}"
        if head == "exit_norm":
            return f"exit_norms.{self.end}.{rest}"
        if head == "readout":
            return f"readouts.{self.depth}.{rest}"
        return name


def build_full(config: Config, stages: int, device: str | None = None) -> ByteTransformer:
    """The whole model with exits at the stage boundaries, initialised exactly as global backprop's model."""
    if device == "meta":
        with torch.device("meta"):
            return ByteTransformer(staged_model_config(config.model, stages))
    torch.manual_seed(config.train.seed)
    return ByteTransformer(staged_model_config(config.model, stages))


def build_stage_modules(full: ByteTransformer, stages: int) -> list[StageModule]:
    bounds = stage_bounds(full.config.depth, stages)
    return [StageModule(full, start, end, owner=i == stages - 1) for i, (start, end) in enumerate(bounds)]


def build_stage_module(config: Config, stages: int, index: int) -> StageModule:
    """Stage ``index`` alone (the rest of the freshly built model is dropped)."""
    return build_stage_modules(build_full(config, stages), stages)[index]


def parameter_layout(config: Config, stages: int, index: int) -> list[tuple[str, tuple[int, ...]]]:
    """(full name, shape) of stage ``index``'s parameters, in the order its parameter segment stores them."""
    module = build_stage_modules(build_full(config, stages, device="meta"), stages)[index]
    return [(module.full_name(n), tuple(p.shape)) for n, p in module.named_parameters()]


class Stage:
    """A stage module with its AdamW, learning-rate schedule and gradient clipping (as the ``Trainer``'s)."""

    def __init__(self, module: StageModule, train: TrainConfig) -> None:
        self.module = module
        self.train = train
        self.optimizer = AdamW(param_groups(module, train.weight_decay), lr=train.lr, betas=(train.beta1, train.beta2))
        self.step = 0
        self._params = list(module.parameters())

    def apply(self) -> None:
        """Clip this stage's gradient, take one AdamW step at the scheduled rate, and clear the gradients."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.train, self.step)
        if self.train.grad_clip > 0:
            clip_grad_norm(self._params, self.train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step += 1

    def numel(self) -> int:
        return sum(p.numel() for p in self._params)

    @torch.no_grad()
    def copy_params_to(self, flat: np.ndarray) -> None:
        """Write every parameter, in order, into a flat float32 array (a parameter segment)."""
        out, offset = torch.from_numpy(flat), 0
        for p in self._params:
            out[offset : offset + p.numel()].copy_(p.reshape(-1))
            offset += p.numel()

    @torch.no_grad()
    def load_params_from(self, flat: np.ndarray) -> None:
        source, offset = torch.from_numpy(flat), 0
        for p in self._params:
            p.copy_(source[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
