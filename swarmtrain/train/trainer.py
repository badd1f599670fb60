"""The inner optimiser: AdamW steps of the byte transformer on random windows of a corpus.

``Trainer`` holds the model, the optimizer and the position in the data (the step), and nothing about where
its steps come from: ``swarmtrain train`` drives it alone, a swarm node drives it for H inner steps per round.
Its whole state goes in and out as named tensors plus JSON metadata, which is what a checkpoint stores.

The model and AdamW live on ``train.device`` (see ``swarmtrain.train.device``); batches are moved there, and
``train.precision = bf16`` autocasts the forward pass on that device type while the weights, the optimizer state
and the update stay fp32. What leaves the trainer (``state``, a node's parameter vector) is on the CPU: the CPU
is one device among the others here, with the same code path.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from swarmtrain.config import Config
from swarmtrain.data import Corpus, eval_starts, train_batch, windows
from swarmtrain.errors import CheckpointError
from swarmtrain.model import VOCAB, ByteTransformer, param_groups
from swarmtrain.train.checkpoint import Checkpoint, load_optimizer_tensors, optimizer_tensors
from swarmtrain.train.device import resolve_device


def configure_threads(threads: int) -> int:
    """Set torch's compute threads (0 means all cores) and one inter-op thread; return the count used."""
    count = threads or os.cpu_count() or 1
    torch.set_num_threads(count)
    return count


@torch.no_grad()
def evaluate_bpb(model: ByteTransformer, val: np.ndarray, config: Config, device: torch.device | None = None) -> float:
    """Held-out bits per byte of ``model`` on the same windows of the validation bytes ``val`` every time."""
    t, context = config.train, config.model.context
    starts = eval_starts(val, t.eval_batches * t.batch_size, context)
    was_training = model.training
    model.eval()
    total = 0.0
    for chunk in starts.reshape(t.eval_batches, t.batch_size):
        batch = windows(val, chunk, context).to(device or "cpu")
        logits = model(batch[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1), reduction="sum").item()
    model.train(was_training)
    return total / (len(starts) * context) / math.log(2)


class Trainer:
    def __init__(self, config: Config, corpus: Corpus, data_seed: int | None = None) -> None:
        corpus.check_context(config.model.context)
        self.config = config
        self.corpus = corpus
        self.device = resolve_device(config.train.device)
        torch.manual_seed(config.train.seed)
        self.model = ByteTransformer(config.model).to(self.device)  # initialised on the CPU: the same on every device
        t = config.train
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), foreach=True
        )
        self.data_seed = config.train.seed if data_seed is None else data_seed
        self.step = 0
        self.tokens = 0

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
        t = self.config.train
        if step < t.warmup_steps:
            return t.lr * (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
        return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def train_step(self) -> float:
        """One AdamW step on the batch for the current step; returns the training loss in nats per byte."""
        t, context = self.config.train, self.config.model.context
        batch = train_batch(self.corpus.train, t.batch_size, context, self.data_seed, self.step).to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.model.train()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16"):
            logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.optimizer.step()
        self.step += 1
        self.tokens += batch.shape[0] * context
        return loss.item()

    def evaluate(self, val: np.ndarray | None = None) -> float:
        """Held-out bits per byte on the fixed validation windows (of ``val``, else of the corpus)."""
        return evaluate_bpb(self.model, self.corpus.val if val is None else val, self.config, self.device)

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Everything needed to continue this run bit for bit: named tensors and JSON metadata."""
        tensors = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        optim, groups = optimizer_tensors(self.optimizer)
        tensors.update(optim)
        tensors = {k: v.detach().cpu() for k, v in tensors.items()}  # a checkpoint loads on any device
        meta = {
            "step": self.step,
            "tokens": self.tokens,
            "data_position": {"seed": self.data_seed, "next_step": self.step},
            "optimizer_groups": groups,
            "config": self.config.model_dump(),
        }
        return tensors, meta

    def check_compatible(self, checkpoint: Checkpoint) -> None:
        """Raise ``CheckpointError`` if ``checkpoint`` was written for a different model shape."""
        check_compatible(checkpoint, self.config)

    def load_state(self, checkpoint: Checkpoint) -> None:
        self.check_compatible(checkpoint)
        model_state = {k[len("model.") :]: v for k, v in checkpoint.tensors.items() if k.startswith("model.")}
        self.model.load_state_dict(model_state)
        load_optimizer_tensors(self.optimizer, checkpoint.tensors, checkpoint.meta["optimizer_groups"])
        self.step = int(checkpoint.meta["step"])
        self.tokens = int(checkpoint.meta["tokens"])


def check_compatible(checkpoint: Checkpoint, config: Config) -> None:
    """Raise ``CheckpointError`` if ``checkpoint`` was written for another model shape than ``config.model``."""
    saved = checkpoint.meta.get("config", {}).get("model")
    wanted = config.model.model_dump()
    if saved != wanted:
        diffs = ", ".join(
            f"model.{k}={saved.get(k)!r} there vs {wanted[k]!r} here"
            for k in wanted
            if not isinstance(saved, dict) or saved.get(k) != wanted[k]
        )
        raise CheckpointError(
            f"checkpoint error: {checkpoint.path} was written for a different model ({diffs or 'unknown'}). "
            "Resume with the model settings it was written with, or start a new run with a new --run-dir."
        )
