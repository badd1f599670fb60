"""``swarmtrain train``: single-node training with progress, periodic evaluation and atomic checkpoints.

swarmtrain train --data notes.txt --max-time 300
swarmtrain train --run-dir runs/default --resume
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from swarmtrain.config import Config, write_resolved
from swarmtrain.data import load_corpus
from swarmtrain.errors import CheckpointError, ConfigError
from swarmtrain.model import count_parameters
from swarmtrain.train.checkpoint import (
    find_resumable,
    list_checkpoints,
    no_intact_checkpoint,
    remove_stale_temps,
    save_checkpoint,
)
from swarmtrain.train.trainer import Trainer, configure_threads


def _append_jsonl(path: Path, record: dict[str, object]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def run_training(config: Config, resume: bool = False, console: Console | None = None) -> float:
    """Train until ``train.max_steps`` or ``train.max_time``; return the final held-out bits per byte.

    Everything that can fail on bad input (config, corpus, checkpoint compatibility) is checked before the
    run directory is touched, so a failed start never damages an earlier run.
    """
    console = console or Console(soft_wrap=True)
    if config.train.trainer != "standard":
        raise ConfigError(
            f"config error: train.trainer = {config.train.trainer!r} selects the inner trainer of `swarmtrain node`; "
            "`swarmtrain train` always runs the standard trainer. Drop the setting here, or compare localtrain "
            "with global backprop on this machine with `swarmtrain localtrain bench`."
        )
    run_dir = Path(config.run_dir)
    corpus = load_corpus(config.data)
    corpus.check_context(config.model.context)
    checkpoint, skipped = None, ""
    if resume:
        found = find_resumable(run_dir)
        checkpoint, skipped = found.checkpoint, found.report()
        if checkpoint is None:
            raise no_intact_checkpoint(
                run_dir, found, "Drop --resume to start a new run there, or point --run-dir at the run to continue."
            )
    elif existing := list_checkpoints(run_dir):
        raise CheckpointError(
            f"checkpoint error: {run_dir} already holds a run (latest checkpoint {existing[-1].name}). "
            "Pass --resume to continue it, or choose a new --run-dir to start another."
        )
    threads = configure_threads(config.train.threads)
    trainer = Trainer(config, corpus)
    if checkpoint is not None:
        trainer.load_state(checkpoint)
    remove_stale_temps(run_dir)
    write_resolved(config, run_dir)
    metrics_path = run_dir / "metrics.jsonl"

    m, t = config.model, config.train
    console.print(
        f"model: {count_parameters(trainer.model):,} parameters (depth {m.depth}, width {m.width}, heads {m.heads}, "
        f"context {m.context}); corpus: {corpus.description}, {len(corpus.train):,} train / {len(corpus.val):,} "
        f"held-out bytes; on {trainer.device}, {threads} threads; run dir {run_dir}"
    )
    if skipped:
        console.print(skipped)
    if checkpoint is not None:
        console.print(f"resumed from {checkpoint.path.name} at step {trainer.step}")

    def checkpoint_now() -> None:
        tensors, meta = trainer.state()
        save_checkpoint(run_dir, tensors, meta, keep=t.keep_checkpoints)

    evaluated_at = -1

    def evaluate(elapsed: float, loss: float | None) -> float:
        nonlocal evaluated_at
        evaluated_at = trainer.step
        bpb = trainer.evaluate()
        record = {"kind": "eval", "step": trainer.step, "tokens": trainer.tokens, "elapsed_s": round(elapsed, 3)}
        record.update({"loss": loss, "bpb": bpb})
        _append_jsonl(metrics_path, record)
        return bpb

    bpb = evaluate(0.0, None) if trainer.step == 0 else float("nan")
    if trainer.step == 0:
        console.print(f"step 0: held-out bpb {bpb:.3f}")
    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  {task.fields[speed]} tok/s"),
        TimeElapsedColumn(),
        console=console,
    )
    train_time, loss, window_tokens, window_start = 0.0, float("nan"), 0, time.perf_counter()
    interrupted = False
    with progress:
        task = progress.add_task("train", total=t.max_steps, completed=trainer.step, loss="-", speed="-")
        try:
            while trainer.step < t.max_steps and (t.max_time is None or train_time < t.max_time):
                started = time.perf_counter()
                loss = trainer.train_step()
                train_time += time.perf_counter() - started
                window_tokens += t.batch_size * m.context
                if trainer.step % t.log_every == 0:
                    now = time.perf_counter()
                    speed = window_tokens / max(now - window_start, 1e-9)
                    progress.update(task, completed=trainer.step, loss=f"{loss:.3f}", speed=f"{speed:,.0f}")
                    window_tokens, window_start = 0, now
                if trainer.step % t.eval_every == 0:
                    bpb = evaluate(train_time, loss)
                    progress.console.print(f"step {trainer.step}: loss {loss:.3f}, held-out bpb {bpb:.3f}")
                if trainer.step % t.checkpoint_every == 0:
                    checkpoint_now()
        except KeyboardInterrupt:
            interrupted = True
        progress.update(task, completed=trainer.step)
    if evaluated_at != trainer.step:
        bpb = evaluate(train_time, loss)
    checkpoint_now()
    if interrupted:
        console.print(f"interrupted at step {trainer.step}; checkpoint written, continue with --resume")
    console.print(f"trained {trainer.step} steps, {trainer.tokens:,} tokens in {train_time:.0f} s of training")
    console.print(f"held-out bpb {bpb:.3f}")
    return bpb
