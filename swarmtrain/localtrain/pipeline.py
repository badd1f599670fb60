"""The async methods: upstream stages in their own processes, the last stage (the readout's owner) in this one.

This process creates every shared-memory segment (control block, one activation ring per stage boundary, one
readout-gradient ring per upstream stage for RGC, the readout snapshot, one parameter segment per upstream
stage), starts the upstream stages (forked from this process's zygote if it started one before any torch op, so
that they share torch's pages with it; else spawned), and runs the owner: per step it copies the activation of
that step out of the last ring, trains its blocks and the readout on the last exit's loss, averages its readout
gradient with the upstream ones of the same step (``rgc-async``; ``broadcast-async`` uses its own only), steps,
and publishes the new readout as the next snapshot version. Running the owner here rather than in another child
saves one process's memory. ``close`` (also on error and Ctrl+C) stops or aborts the stages, reaps them, and
unlinks every segment in ``finally``.

Upstream stages run ahead by at most ``ring_depth`` steps per boundary and stop at the *horizon*
(``train.max_steps`` unless ``set_horizon`` moves it). Gathering or loading parameters needs a drained
pipeline, i.e. the owner at the horizon.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import time

import numpy as np
import torch

from swarmtrain.config import Config
from swarmtrain.data import Corpus, train_batch
from swarmtrain.localtrain.config import ASYNC_METHODS, LocalTrainConfig, split_threads, stage_cores, thread_env
from swarmtrain.localtrain.control import Command, Control, StageState, Stat
from swarmtrain.localtrain.errors import LocalTrainError, StageFailed, WaitTimeout
from swarmtrain.localtrain.rgc import ReadoutConsensus
from swarmtrain.localtrain.ring import Ring, wait_until
from swarmtrain.localtrain.shm import Segments
from swarmtrain.localtrain.snapshot import Snapshot
from swarmtrain.localtrain.stage import Stage, build_stage_module, local_loss, parameter_layout, setup_threads
from swarmtrain.localtrain.worker import StageSpec, stage_main
from swarmtrain.localtrain.zygote import ForkedProcess, Zygote, take_zygote
from swarmtrain.model import VOCAB, ByteTransformer
from swarmtrain.signals import stop_on_signals

log = logging.getLogger(__name__)

JOIN_TIMEOUT = 30.0
LOG_EVERY = 50


class PipelineEngine:
    def __init__(
        self,
        config: Config,
        corpus: Corpus,
        lt: LocalTrainConfig,
        prefix: str | None = None,
        horizon: int | None = None,
        data_seed: int | None = None,
    ) -> None:
        if lt.method not in ASYNC_METHODS:
            raise LocalTrainError(f"config error: {lt.method} is not an async method ({', '.join(ASYNC_METHODS)}).")
        if lt.stages < 2:
            raise LocalTrainError("config error: the async methods need localtrain.stages >= 2.")
        self.config, self.corpus, self.lt = config, corpus, lt
        self.data_seed = config.train.seed if data_seed is None else data_seed
        self.stages = lt.stages
        self.rgc = lt.method == "rgc-async"
        self.threads = split_threads(lt)
        pinned = stage_cores(lt, self.threads) if lt.pin_cores else None
        self.cores: list[list[int] | None] = list(pinned) if pinned else [None] * lt.stages
        setup_threads(self.threads[-1], self.cores[-1])
        self.segments = Segments(prefix)
        self.procs: list[mp.process.BaseProcess | ForkedProcess] = []
        self._zygote: Zygote | None = None
        self._rings: list[Ring] = []
        self._param_shms: list = []
        self._closed = False
        self.step = 0
        self.tokens = 0
        self.version = 0
        self._first_start: float | None = None
        self.consensus = ReadoutConsensus(lt.stages - 1)
        self.control: Control | None = None
        self.snapshot: Snapshot | None = None
        # Ctrl+C, SIGTERM and SIGHUP stop the stages and unlink the segments, also in a process started with SIGINT
        # ignored; ``close`` gives the handlers back.
        self._signals = contextlib.ExitStack()
        self._signals.enter_context(stop_on_signals())
        try:
            self._start(config.train.max_steps if horizon is None else horizon)
        except BaseException:
            self.close(abort=True)
            raise

    @property
    def prefix(self) -> str:
        return self.segments.prefix

    # -- start-up ---------------------------------------------------------------------------------------------
    def _start(self, horizon: int) -> None:
        config, lt, S = self.config, self.lt, self.stages
        model, train = config.model, config.train
        self.control = control = Control.create(self.segments, S, os.getpid())
        act_bytes = train.batch_size * model.context * model.width * 4
        readout_shape = (VOCAB, model.width)
        act_rings = [Ring.create(self.segments, f"act{i}", lt.ring_depth, act_bytes) for i in range(S - 1)]
        grad_rings = (
            [Ring.create(self.segments, f"grad{i}", lt.ring_depth, VOCAB * model.width * 4) for i in range(S - 1)]
            if self.rgc
            else []
        )
        self._rings = act_rings + grad_rings
        self.snapshot = Snapshot.create(self.segments, "snap", readout_shape)
        self.layouts = [parameter_layout(config, S, i) for i in range(S - 1)]
        self._param_shms = [
            self.segments.create(f"par{i}", 4 * sum(int(np.prod(s)) for _, s in layout))
            for i, layout in enumerate(self.layouts)
        ]
        context = mp.get_context("spawn")
        self._zygote = zygote = take_zygote()
        for i in range(S - 1):
            spec = StageSpec(
                index=i,
                stages=S,
                method=lt.method,
                config=config.model_dump(),
                data_seed=self.data_seed,
                threads=self.threads[i],
                cores=self.cores[i],
                ring_depth=lt.ring_depth,
                wait_timeout=lt.wait_timeout,
                parent_pid=os.getpid(),
                control=control.name,
                act_in=act_rings[i - 1].spec if i > 0 else None,
                act_out=act_rings[i].spec,
                grad_out=grad_rings[i].spec if self.rgc else None,
                snapshot=self.snapshot.name,
                readout_shape=readout_shape,
                params=self._param_shms[i].name,
            )
            proc: mp.process.BaseProcess | ForkedProcess
            if zygote is not None:  # shares torch's pages with this process; the stage sets its threads itself
                proc = zygote.start(stage_main, (spec,), f"localtrain-stage{i}")
            else:
                with thread_env(self.threads[i]):
                    proc = context.Process(target=stage_main, args=(spec,), name=f"localtrain-stage{i}", daemon=True)
                    proc.start()
            self.procs.append(proc)
        if zygote is not None and zygote.subreaper:
            zygote.retire()  # its stages become this process's children, and its pages are freed
        control.set_pid(S - 1, os.getpid())
        self.owner = Stage(build_stage_module(config, S, S - 1), train)
        self.readout = self.owner.module.readout.weight
        self.snapshot.publish(self.readout.detach().numpy(), self.version)
        owner = f"stage {S - 1} (the owner, pid {os.getpid()})"
        self.act_in = act_rings[-1].bind("consumer", self.check, label=owner)
        self.grad_in = [ring.bind("consumer", self.check, label=owner) for ring in grad_rings]

        def starting() -> list[int]:
            return [i for i in range(S - 1) if control.state(i) == StageState.STARTING]

        try:
            wait_until(lambda: not starting(), self.check, lt.start_timeout, "the stage processes to start")
        except WaitTimeout:
            raise LocalTrainError(
                f"localtrain error: {self._stages(starting())} did not start within localtrain.start_timeout = "
                f"{lt.start_timeout:g} s (importing torch and building a stage's part of the model). On a busy or "
                "slow machine raise it (--set localtrain.start_timeout=600), or use fewer localtrain.stages."
            ) from None
        self.check()
        control.set_state(S - 1, StageState.RUNNING)
        control.horizon = horizon

    def _stages(self, indices: list[int]) -> str:
        pids = {i: getattr(self.procs[i], "pid", None) if i < len(self.procs) else None for i in indices}
        named = ", ".join(f"{i} (pid {pids[i]})" for i in indices)
        return f"stage {named}" if len(indices) == 1 else f"stages {named}"

    def check(self) -> None:
        """Raise ``StageFailed`` if a stage process died or reported an error (runs during every wait)."""
        control = self.control
        for i, proc in enumerate(self.procs):
            failed = control is not None and control.state(i) == StageState.FAILED
            if failed or not proc.is_alive():
                detail = control.error(i).strip() if control is not None else ""
                code = "" if proc.exitcode is None else f" with code {proc.exitcode}"
                last = detail.splitlines()[-1] if detail else f"it exited{code}"
                if detail:
                    log.error("stage %d traceback:\n%s", i, detail)
                raise StageFailed(
                    f"localtrain error: stage {i} (pid {proc.pid}) failed: {last}. The run is stopped and its shared "
                    "memory released; the stage's traceback is in the log. Fix the cause (often memory: try a "
                    "smaller train.batch_size) and rerun."
                )

    # -- training ---------------------------------------------------------------------------------------------
    def set_horizon(self, steps: int) -> None:
        """Let the stages run up to step ``steps`` (exclusive); the horizon only moves forward."""
        assert self.control is not None
        if steps < self.control.horizon:
            raise LocalTrainError(f"the horizon only moves forward (now {self.control.horizon}, asked {steps}).")
        self.control.horizon = steps

    def train_step(self) -> float:
        control, timeout = self.control, self.lt.wait_timeout
        assert control is not None and self.snapshot is not None
        step = self.step
        if step >= control.horizon:
            raise LocalTrainError(
                f"localtrain error: step {step} is at the pipeline's horizon; call set_horizon(n) with n > {step} "
                "before training further (the horizon bounds how far upstream stages run ahead)."
            )
        stats = control.stats(self.stages - 1)
        start = time.perf_counter()
        rings = [self.act_in, *self.grad_in]
        waits0 = [r.wait_seconds for r in rings]
        copies0 = sum(r.copy_seconds for r in rings)
        t, context = self.config.train, self.config.model.context
        batch = train_batch(self.corpus.train, t.batch_size, context, self.data_seed, step)
        item = self.act_in.get(timeout)
        if item.step != step:
            raise LocalTrainError(f"localtrain error: the owner expected step {step}'s activation, got {item.step}'s")
        module = self.owner.module
        module.train()
        loss = local_loss(module.exit_norm(module(torch.from_numpy(item.data))), self.readout, batch[:, 1:])
        loss.backward()
        if self.rgc:
            grads, lags = [], []
            for ring in self.grad_in:
                grad_item = ring.get(timeout)
                if grad_item.step != step:
                    raise LocalTrainError(
                        f"localtrain error: expected the readout gradient of step {step}, got {grad_item.step}"
                    )
                grads.append(torch.from_numpy(grad_item.data))
                lags.append(self.version - grad_item.version)
            self.readout.grad = self.consensus.combine(self.readout.grad, grads, lags)
            if log.isEnabledFor(logging.DEBUG) and step % LOG_EVERY == 0:
                for i, stats_i in enumerate(self.consensus.stats):
                    log.debug(
                        "step %d: stage %d readout gradient cosine %+.3f (mean %+.3f), snapshot lag %d",
                        step,
                        i,
                        stats_i.cos_last,
                        stats_i.cos_sum / max(stats_i.count, 1),
                        lags[i],
                    )
        self.owner.apply()
        publish0 = time.perf_counter()
        self.version += 1
        self.snapshot.publish(self.readout.detach().numpy(), self.version)
        publish = time.perf_counter() - publish0
        self.step += 1
        self.tokens += batch.shape[0] * context
        end = time.perf_counter()
        wait_in = self.act_in.wait_seconds - waits0[0]
        wait_grads = sum(r.wait_seconds - w for r, w in zip(rings, waits0, strict=True)) - wait_in
        comm = sum(r.copy_seconds for r in rings) - copies0 + publish
        stats[Stat.WAIT_INPUT] += wait_in
        stats[Stat.WAIT_SNAPSHOT] += wait_grads
        stats[Stat.COMM] += comm
        stats[Stat.BUSY] += end - start - wait_in - wait_grads - comm
        if self._first_start is None:
            self._first_start = start
        stats[Stat.WALL] = end - self._first_start
        stats[Stat.STEPS] += 1
        value = loss.item()
        stats[Stat.LOSS] = value
        control.set_steps_done(self.stages - 1, self.step)
        return value

    # -- parameters -------------------------------------------------------------------------------------------
    def _drain(self) -> None:
        control = self.control
        assert control is not None
        if self.step != control.horizon:
            raise LocalTrainError(
                f"localtrain error: parameters can be gathered or loaded only with a drained pipeline (the owner at "
                f"its horizon, step {control.horizon}); it is at step {self.step}. Call set_horizon(step + H) "
                "before H inner steps so the pipeline drains at their end."
            )

        def behind() -> list[int]:
            return [i for i in range(self.stages - 1) if control.steps_done(i) < self.step]

        try:
            wait_until(lambda: not behind(), self.check, self.lt.wait_timeout, "the stages to drain")
        except WaitTimeout:
            raise WaitTimeout(
                f"draining the pipeline at step {self.step}: {self._stages(behind())} did not reach it within "
                f"localtrain.wait_timeout = {self.lt.wait_timeout:g} s"
            ) from None

    def _command(self, index: int, command: Command) -> None:
        control = self.control
        assert control is not None
        seq = control.send(index, command)
        wait_until(
            lambda: control.acked(index) >= seq,
            self.check,
            self.lt.wait_timeout,
            f"{self._stages([index])} to acknowledge {command.name}",
        )

    def gathered_state(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, by its ``ByteTransformer`` name (copies, not live tensors)."""
        self._drain()
        state: dict[str, torch.Tensor] = {}
        for i, layout in enumerate(self.layouts):
            self._command(i, Command.GATHER)
            flat = torch.from_numpy(np.ndarray((self._numel(i),), np.float32, buffer=self._param_shms[i].buf).copy())
            offset = 0
            for name, shape in layout:
                size = int(np.prod(shape))
                state[name] = flat[offset : offset + size].view(shape)
                offset += size
        module = self.owner.module
        state.update({module.full_name(n): p.detach().clone() for n, p in module.named_parameters()})
        return state

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Overwrite every stage's parameters (optimizer states stay) and publish the new readout."""
        self._drain()
        for i, layout in enumerate(self.layouts):
            flat = np.ndarray((self._numel(i),), np.float32, buffer=self._param_shms[i].buf)
            offset = 0
            for name, shape in layout:
                size = int(np.prod(shape))
                flat[offset : offset + size] = state[name].detach().reshape(-1).numpy()
                offset += size
            del flat
            self._command(i, Command.LOAD)
        module = self.owner.module
        with torch.no_grad():
            for n, p in module.named_parameters():
                p.copy_(state[module.full_name(n)])
        assert self.snapshot is not None
        self.version += 1
        self.snapshot.publish(self.readout.detach().numpy(), self.version)

    def _numel(self, index: int) -> int:
        return sum(int(np.prod(s)) for _, s in self.layouts[index])

    def gathered_model(self) -> ByteTransformer:
        from swarmtrain.localtrain.stage import build_full

        model = build_full(self.config, self.stages, device="meta")
        model.load_state_dict(self.gathered_state(), assign=True)
        return model

    def breakdown(self) -> dict[str, object]:
        control = self.control
        assert control is not None
        stages = []
        for i in range(self.stages):
            s = control.stats(i)
            steps = max(float(s[Stat.STEPS]), 1.0)
            stages.append(
                {
                    "stage": i,
                    "threads": self.threads[i],
                    "busy_s": float(s[Stat.BUSY]),
                    "wait_input_s": float(s[Stat.WAIT_INPUT]),
                    "wait_output_s": float(s[Stat.WAIT_OUTPUT]),
                    "wait_readout_s": float(s[Stat.WAIT_SNAPSHOT]),
                    "comm_s": float(s[Stat.COMM]),
                    "wall_s": float(s[Stat.WALL]),
                    "last_loss": float(s[Stat.LOSS]),
                    "lag_mean": float(s[Stat.LAG_SUM]) / steps if i < self.stages - 1 else 0.0,
                    "lag_max": float(s[Stat.LAG_MAX]),
                }
            )
        return {"stages": stages, "readout": self.consensus.summary() if self.rgc else []}

    # -- shutdown ---------------------------------------------------------------------------------------------
    def close(self, abort: bool = False) -> None:
        """Stop (or abort) the stages, reap them, and unlink every segment; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for i, summary in enumerate(self.consensus.summary() if self.rgc and self.step else []):
            log.info(
                "stage %d readout gradients vs the owner's over %d steps: cosine mean %+.3f, min %+.3f, negative "
                "%.1f%%; snapshot lag mean %.2f, max %d",
                i,
                summary["grads"],
                summary["cos_mean"],
                summary["cos_min"],
                100 * summary["cos_negative_frac"],
                summary["lag_mean"],
                summary["lag_max"],
            )
        try:
            if self.control is not None:
                (self.control.abort if abort else self.control.stop)()
            deadline = time.monotonic() + JOIN_TIMEOUT
            for proc in self.procs:
                proc.join(timeout=max(0.1, deadline - time.monotonic()))
            for proc in self.procs:
                if proc.is_alive():
                    log.warning("stage process %s did not stop in time; killing it", proc.pid)
                    proc.kill()
                    proc.join(timeout=5.0)
        finally:
            if self._zygote is not None:
                self._zygote.close()
            for handle in [*self._rings, self.snapshot, self.control]:
                if handle is not None:
                    with contextlib.suppress(Exception):
                        handle.detach()
            self.segments.unlink_all()
            self._signals.close()
