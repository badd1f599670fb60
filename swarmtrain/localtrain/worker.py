"""An upstream stage process: its blocks, its optimizer, its local loss, and its ends of the rings.

Started by the pipeline (the readout's owner): forked from the zygote when the process has one
(``swarmtrain.localtrain.zygote``), else with the ``spawn`` context. Its loop, per step ``t`` below the
horizon: take the input (bytes for the first stage, else an activation copied out of the ring), run the blocks,
publish the output activation downstream at once (so the next stage starts while this one runs backward), take
the freshest readout snapshot (waiting only if it is more than ``ring_depth`` versions per stage of distance
behind), compute the local loss through the exit, backward, send the readout gradient tagged with the snapshot
version (RGC), step the optimizer. Between steps it answers the parent's commands (gather or load parameters).

It ignores SIGINT (the parent handles Ctrl+C and sets the abort flag) and leaves when the parent asks it to
stop, aborts, or dies (its parent becomes neither the pipeline's process nor the zygote it was forked from,
which leaves when the pipeline's process dies); an error is written into its control slot for the parent to
report.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from swarmtrain.config import Config
from swarmtrain.data import load_corpus, train_batch
from swarmtrain.localtrain.control import Command, Control, StageState, Stat
from swarmtrain.localtrain.errors import Aborted, ChannelError, PeerLost
from swarmtrain.localtrain.ring import Ring, RingSpec, wait_until
from swarmtrain.localtrain.shm import attach_segment, close_segment
from swarmtrain.localtrain.snapshot import Snapshot
from swarmtrain.localtrain.stage import Stage, build_stage_module, local_loss, setup_threads


@dataclass(frozen=True)
class StageSpec:
    """Everything an upstream stage process needs (pickled once, at start-up)."""

    index: int
    stages: int
    method: str
    config: dict[str, Any]
    data_seed: int
    threads: int
    cores: list[int] | None
    ring_depth: int
    wait_timeout: float
    parent_pid: int
    control: str
    act_in: RingSpec | None
    act_out: RingSpec
    grad_out: RingSpec | None
    snapshot: str
    readout_shape: tuple[int, int]
    params: str


class UpstreamWorker:
    def __init__(self, spec: StageSpec, control: Control) -> None:
        self.spec, self.control = spec, control
        self.config = Config.model_validate(spec.config)
        self.corpus = load_corpus(self.config.data)
        self.rgc = spec.method == "rgc-async"
        self._handles: list[Any] = []
        me = f"stage {spec.index}"
        self.act_in = (
            self._keep(Ring.attach(spec.act_in).bind("consumer", self.check, label=me)) if spec.act_in else None
        )
        self.act_out = self._keep(Ring.attach(spec.act_out).bind("producer", self.check, label=me))
        self.grad_out = (
            self._keep(Ring.attach(spec.grad_out).bind("producer", self.check, label=me)) if spec.grad_out else None
        )
        self.snapshot = self._keep(Snapshot.attach(spec.snapshot, spec.readout_shape))
        self.params_shm = attach_segment(spec.params)
        self.stage = Stage(build_stage_module(self.config, spec.stages, spec.index), self.config.train)
        self.readout_np = np.zeros(spec.readout_shape, dtype=np.float32)
        self.readout = torch.from_numpy(self.readout_np).requires_grad_(self.rgc)
        self.readout_version = -1
        self.max_lag = spec.ring_depth * (spec.stages - 1 - spec.index)
        self.stats = control.stats(spec.index)
        self.parent = os.getppid()  # the pipeline's process, or its zygote (which leaves when the pipeline dies)
        self._first_start: float | None = None

    def _keep(self, handle: Any) -> Any:
        self._handles.append(handle)
        return handle

    def check(self) -> None:
        """Runs during every wait: leave on abort, stop, or the parent's death."""
        if self.control.aborted or self.control.stopping:
            raise Aborted("the run is shutting down")
        if os.getppid() not in (self.parent, self.spec.parent_pid):  # the zygote retired: adopted by the pipeline
            raise PeerLost(f"the parent process {self.spec.parent_pid} died")

    def run(self) -> None:
        control, index = self.control, self.spec.index
        while True:
            self.check()
            self.handle_command()
            step = self.stage.step
            if step < control.horizon:
                self.train_step(step)
            else:  # at the horizon: idle until it moves, a command arrives, or the run ends
                wait_until(
                    lambda: self.stage.step < control.horizon or control.pending(index) is not None,
                    self.check,
                    float("inf"),
                )

    def handle_command(self) -> None:
        pending = self.control.pending(self.spec.index)
        if pending is None:
            return
        seq, command = pending
        flat = np.ndarray((self.stage.numel(),), dtype=np.float32, buffer=self.params_shm.buf)
        if command == Command.GATHER:
            self.stage.copy_params_to(flat)
        elif command == Command.LOAD:
            self.stage.load_params_from(flat)
        del flat
        self.control.ack(self.spec.index, seq)

    def _refresh_readout(self, step: int) -> None:
        """Take the newest snapshot; wait only if the cached one is more than ``max_lag`` versions behind."""
        need = step - self.max_lag
        if self.snapshot.version > self.readout_version or self.readout_version < need:
            if self.snapshot.version < need:
                self.snapshot.wait_for(need, self.check, self.spec.wait_timeout, who=f"stage {self.spec.index}")
            with torch.no_grad():
                self.readout_version = self.snapshot.read_into(
                    self.readout_np, self.check, self.spec.wait_timeout, who=f"stage {self.spec.index}"
                )

    def train_step(self, step: int) -> None:
        spec, stats, timeout = self.spec, self.stats, self.spec.wait_timeout
        start = time.perf_counter()
        if self._first_start is None:
            self._first_start = start
        rings = [r for r in (self.act_in, self.act_out, self.grad_out) if r is not None]
        waits0 = [r.wait_seconds for r in rings]
        copies0 = sum(r.copy_seconds for r in rings)
        snap_wait0 = self.snapshot.wait_seconds
        t, context = self.config.train, self.config.model.context
        batch = train_batch(self.corpus.train, t.batch_size, context, self.spec.data_seed, step)
        if self.act_in is None:
            x = batch[:, :-1]
        else:
            item = self.act_in.get(timeout)
            if item.step != step:
                raise RuntimeError(f"stage {spec.index} expected the activation of step {step}, got {item.step}")
            x = torch.from_numpy(item.data)
        module = self.stage.module
        module.train()
        h = module(x)
        self.act_out.put(h.detach().numpy(), step=step, timeout=timeout)
        snap_copy0 = time.perf_counter()
        self._refresh_readout(step)
        snap_copy = time.perf_counter() - snap_copy0 - (self.snapshot.wait_seconds - snap_wait0)
        loss = local_loss(module.exit_norm(h), self.readout, batch[:, 1:])
        loss.backward()
        if self.grad_out is not None:
            grad = self.readout.grad
            if grad is None:
                raise RuntimeError("the readout snapshot got no gradient")
            self.grad_out.put(grad.numpy(), step=step, version=self.readout_version, timeout=timeout)
            self.readout.grad = None
        self.stage.apply()
        self.control.set_steps_done(spec.index, step + 1)
        end = time.perf_counter()
        waits = [r.wait_seconds - w for r, w in zip(rings, waits0, strict=True)]
        wait_in = waits[0] if self.act_in is not None else 0.0
        wait_out = sum(waits) - wait_in
        snap_wait = self.snapshot.wait_seconds - snap_wait0
        comm = sum(r.copy_seconds for r in rings) - copies0 + snap_copy
        stats[Stat.WAIT_INPUT] += wait_in
        stats[Stat.WAIT_OUTPUT] += wait_out
        stats[Stat.WAIT_SNAPSHOT] += snap_wait
        stats[Stat.COMM] += comm
        stats[Stat.BUSY] += end - start - wait_in - wait_out - snap_wait - comm
        stats[Stat.WALL] = end - self._first_start
        stats[Stat.LOSS] = loss.item()
        lag = max(0, step - self.readout_version)
        stats[Stat.LAG_SUM] += lag
        stats[Stat.LAG_MAX] = max(stats[Stat.LAG_MAX], lag)
        stats[Stat.STEPS] += 1

    def detach(self) -> None:
        if self.act_out is not None and self.control is not None:
            self.act_out.close()
        for handle in self._handles:
            handle.detach()
        self._handles.clear()
        close_segment(self.params_shm)


def stage_main(spec: StageSpec) -> None:
    """Entry point of an upstream stage process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_threads(spec.threads, spec.cores)  # before the first torch op
    control = Control.attach(spec.control, spec.stages)
    control.set_pid(spec.index, os.getpid())
    worker: UpstreamWorker | None = None
    failed = False
    try:
        worker = UpstreamWorker(spec, control)
        control.set_state(spec.index, StageState.READY)
        worker.run()
    except ChannelError:
        failed = not (control.aborted or control.stopping)
        if failed:
            control.set_error(spec.index, traceback.format_exc())
    except BaseException:
        failed = True
        control.set_error(spec.index, traceback.format_exc())
    finally:
        control.set_state(spec.index, StageState.FAILED if failed else StageState.DONE)
        if worker is not None:
            worker.detach()
        control.detach()
    if failed:
        sys.exit(1)
