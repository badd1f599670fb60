"""Our group all-reduce vs the transport's limit and vs hivemind's DecentralizedAverager, side by side in one run.

    python benchmarks/bench_allreduce.py --peers 4 --numel 10000000 --rounds 5
    python benchmarks/bench_allreduce.py --mbit 1000        # each peer behind a link of 1 Gbit/s each way

Each system runs PEERS processes on loopback that average a NUMEL-element fp32 tensor, with fp32 and with fp16
payloads. ``raw`` is the transport's limit: the same processes and daemons (our ``P2PTransport``), each sending
the bytes a butterfly all-reduce sends, 2 x payload / PEERS to each other peer, all at once, in frames of a
node's part size (``--part-numel``), with no encoding, no reduction and no protocol around it (a stream that
breaks is sent again, and the run says how often).
With ``--mbit``, each peer runs in a network namespace of its own whose veth the kernel's ``tbf`` holds to that
rate each way (root and iproute2, as the scenarios' links: ``swarmtrain/scenarios/links.py``), so all three
systems cross the same links; without root, ``--shaper transport`` paces our transport instead (ours and raw
only). On loopback as is, four peers on two cores measure their CPU more than the transport.
Reported per case:
- group wall time: per round, from the moment the last peer calls its step to the moment the last peer is
  done (so waiting for stragglers is not counted, matchmaking is), median over the timed rounds;
- bytes sent per peer per round: everything the loopback interface (or the peers' links) carried during the
  timed rounds (payloads, framing, matchmaking, DHT), divided by peers and rounds; the ideal for a butterfly
  all-reduce is 2 (n - 1) / n x payload;
- CPU seconds per peer per round (ours and raw): the peer process's own CPU time over the timed rounds (its p2p
  daemon not counted). Where peers outnumber cores, a round is bound by this, not by the transfer.
Ours and raw run with a node's process settings (``swarmtrain.memory.reuse_freed_memory``).
``--profile`` also prints where the first of our peers spent its CPU time in a round (cProfile, timed rounds).
The last columns are our time over the raw transfer's and over hivemind's for the same codec.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import ctypes
import json
import multiprocessing as mp
import os
import pstats
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

from swarmtrain.config import AveragingConfig
from swarmtrain.fsutil import atomic_write_bytes
from swarmtrain.memory import reuse_freed_memory
from swarmtrain.scenarios.links import Network, kernel_available
from swarmtrain.signals import stop_on_signals


def lo_tx_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def sent_bytes(net: Network | None) -> int:
    """Bytes the peers have sent: the loopback's count, or with shaped links what their veths' host ends took in."""
    if net is None:
        return lo_tx_bytes()
    return sum(
        int(Path(f"/sys/class/net/{link.host_dev}/statistics/rx_bytes").read_text()) for link in net.links.values()
    )


@dataclass(frozen=True)
class PeerLink:
    """Where a peer runs: its network namespace (None: this one) and its address there, and the pacing of our
    transport (``--shaper transport``; 0: none)."""

    netns: str | None = None
    host: str = "127.0.0.1"
    pace_mbit: float = 0.0

    def enter(self) -> None:
        """Move this process into its namespace, before it opens a socket or starts a daemon (they inherit it)."""
        if self.netns is None:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
        try:
            if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), f"setns into network namespace {self.netns} failed")
        finally:
            os.close(fd)

    @property
    def maddr(self) -> str:
        return f"/ip4/{self.host}/tcp/0"


def _wait_for(path: Path, timeout: float = 120.0, procs: Sequence[mp.process.BaseProcess] = ()) -> None:
    """Wait until ``path`` exists; with ``procs``, fail at once if one of them died instead of waiting out the
    timeout (the others would wait for its bytes to the end)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {path}")
        for i, proc in enumerate(procs):
            if proc.exitcode not in (None, 0):
                raise RuntimeError(f"peer {i} exited with code {proc.exitcode} (its traceback is above)")
        time.sleep(0.01)


def _write(path: Path, text: str) -> None:
    """Write a file another process waits for (``_wait_for``) whole or not at all: a reader that saw it exist
    before its text was in read an empty peer id, and that peer's first send failed its run."""
    atomic_write_bytes(path, text.encode())


def _barrier(workdir: Path, idx: int) -> None:
    (workdir / f"ready{idx}").touch()
    _wait_for(workdir / "go", timeout=600)


async def _barrier_serving(workdir: Path, idx: int) -> None:
    """``_barrier`` for a peer whose event loop serves the others meanwhile: a peer done with its warm-up round
    may still owe another peer the answer to that round's last call (late when links are paced), and a
    blocked loop would never send it, so that peer would never be ready."""
    await asyncio.to_thread(_barrier, workdir, idx)


PART_NUMEL = AveragingConfig().part_numel  # what a node uses by default
RAW_SENDS = 3  # tries of one raw send over streams that break (``SMALL_ATTEMPTS`` of a node's report)


def ours_worker(
    idx: int, peers: int, numel: int, codec: str, rounds: int, workdir: str, link: PeerLink, part_numel: int
) -> None:
    import uvloop
    from hivemind.p2p import P2P

    from swarmtrain.averaging import Averager
    from swarmtrain.compression import get_codec
    from swarmtrain.net import P2PTransport

    torch.set_num_threads(1)
    reuse_freed_memory()  # as a node does (``run_node``)
    link.enter()
    work = Path(workdir)

    async def main() -> None:
        join = [] if idx == 0 else [(work / "maddr0").read_text()]
        p2p = await P2P.create(initial_peers=join or None, host_maddrs=[link.maddr])
        _write(work / f"maddr{idx}", str((await p2p.get_visible_maddrs())[0]))
        transport = P2PTransport(p2p, up_mbit=link.pace_mbit, down_mbit=link.pace_mbit)
        averager = Averager(
            transport, torch.zeros(numel), run_id="bench", group_size=peers, outer_lr=1.0, outer_momentum=0.0,
            codec_up=get_codec(codec), codec_down=get_codec(codec), part_numel=part_numel, min_deadline=60.0,
            deadline_factor=10.0,
        )  # fmt: skip
        await averager.start()
        _write(work / f"id{idx}", transport.peer_id)
        for i in range(peers):
            _wait_for(work / f"id{i}")
        members = sorted((work / f"id{i}").read_text() for i in range(peers))
        delta = torch.randn(numel, generator=torch.Generator().manual_seed(idx))
        profiler = cProfile.Profile(time.process_time) if idx == 0 and (work / "profile").exists() else None
        times = []
        for r in range(rounds + 1):
            if r == 1:
                await _barrier_serving(work, idx)
                cpu = time.process_time()
                if profiler is not None:
                    profiler.enable()
            start = time.time()
            outcome = await averager.run_round(delta, 1.0, members, set(members), gather_timeout=60.0)
            times.append((start, time.time(), outcome.outcome, outcome.group.size, outcome.phases))
        _write(work / f"cpu{idx}", str(time.process_time() - cpu))
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(work / "peer0.prof")
        _write(work / f"result{idx}.json", json.dumps(times[1:]))
        await asyncio.sleep(1.0)  # let the others finish reading our last results
        await p2p.shutdown()

    uvloop.run(main())


def raw_worker(
    idx: int, peers: int, numel: int, codec: str, rounds: int, workdir: str, link: PeerLink, part_numel: int
) -> None:
    """Send 2 x payload / peers bytes to every other peer at once, every round; a round ends for this peer when
    its sends are done and every other peer's bytes of that round arrived. A stream that breaks is sent again
    (at most ``RAW_SENDS`` times), as a node sends again or falls back: the run goes on, and says how often."""
    import uvloop
    from hivemind.p2p import P2P

    from swarmtrain.net import P2PTransport, PeerUnreachable

    reuse_freed_memory()  # the same process settings as ours
    link.enter()
    work = Path(workdir)
    elem = 2 if codec == "fp16" else 4
    frame = part_numel * elem
    share = 2 * numel * elem // peers
    frames = [b"\x01" * frame] * (share // frame) + ([b"\x01" * (share % frame)] if share % frame else [])

    async def main() -> None:
        join = [] if idx == 0 else [(work / "maddr0").read_text()]
        p2p = await P2P.create(initial_peers=join or None, host_maddrs=[link.maddr])
        _write(work / f"maddr{idx}", str((await p2p.get_visible_maddrs())[0]))
        transport = P2PTransport(p2p, up_mbit=link.pace_mbit, down_mbit=link.pace_mbit)
        arrived: dict[int, set[str]] = {}
        events: dict[int, asyncio.Event] = {}

        async def on_raw(sender: str, header: dict, body) -> tuple[dict, bytes]:
            async for _ in body:
                pass
            arrived.setdefault(header["round"], set()).add(sender)
            if len(arrived[header["round"]]) == peers - 1:
                events.setdefault(header["round"], asyncio.Event()).set()
            return {}, b""

        await transport.serve_stream("raw", on_raw, max_body=frame, max_frames=len(frames) + 1)
        _write(work / f"id{idx}", transport.peer_id)
        for i in range(peers):
            _wait_for(work / f"id{i}")
        others = [(work / f"id{i}").read_text() for i in range(peers) if i != idx]

        async def send(peer: str, round_: int) -> int:
            """Send this round's bytes to ``peer``; returns how many times a broken stream was sent again."""

            async def body():
                for f in frames:
                    yield f

            again = 0
            while True:
                try:
                    await transport.call_stream(peer, "raw", {"round": round_}, body(), count=len(frames), timeout=120)
                    return again
                except PeerUnreachable:
                    again += 1
                    if again == RAW_SENDS:
                        raise

        times = []
        for r in range(rounds + 1):
            if r == 1:
                await _barrier_serving(work, idx)
                cpu = time.process_time()
            start = time.time()
            resent = sum(await asyncio.gather(*(send(p, r) for p in others)))
            await events.setdefault(r, asyncio.Event()).wait()
            times.append((start, time.time(), "applied", peers, {"resent": resent}))
        _write(work / f"cpu{idx}", str(time.process_time() - cpu))
        _write(work / f"result{idx}.json", json.dumps(times[1:]))
        await asyncio.sleep(1.0)
        await p2p.shutdown()

    uvloop.run(main())


def hivemind_worker(idx: int, peers: int, numel: int, codec: str, rounds: int, workdir: str, link: PeerLink) -> None:
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import Float16Compression, NoCompression
    from hivemind.dht import DHT

    mp.set_start_method("fork", force=True)  # hivemind's DHT and averager are fork-started mp.Process children
    torch.set_num_threads(1)
    link.enter()
    work = Path(workdir)
    join = [] if idx == 0 else [(work / "maddr0").read_text()]
    dht = DHT(initial_peers=join, host_maddrs=[link.maddr], start=True)
    _write(work / f"maddr{idx}", str(dht.get_visible_maddrs()[0]))
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(idx))
    averager = DecentralizedAverager(
        [tensor], dht, start=True, prefix="bench", target_group_size=peers, min_group_size=peers,
        min_matchmaking_time=1.0, request_timeout=3.0,
        compression=Float16Compression() if codec == "fp16" else NoCompression(),
    )  # fmt: skip
    times = []
    for r in range(rounds + 1):
        if r == 1:
            _barrier(work, idx)
        start = time.time()
        result = averager.step(timeout=120)
        times.append((start, time.time(), "applied" if result else "failed", len(result or {})))
    _write(work / f"result{idx}.json", json.dumps(times[1:]))
    time.sleep(1.0)
    averager.shutdown()
    dht.shutdown()


# Where a peer of ours spends its CPU time in a round (``--profile``): (label, file, function).
PROFILED = [
    ("encode its parts (codec, error feedback)", "allreduce.py", "_encode_up"),
    ("decode and check the parts and results it receives", "allreduce.py", "_store"),
    ("reduce its shard (the aggregator)", "robust.py", "reduce"),
    ("hash the results for the report", "allreduce.py", "_hash_arrived"),
    ("give back to the residual what the group did not apply", "allreduce.py", "_give_back"),
    ("outer step", "outer.py", "step"),
    ("hash the new state for the digest vote", "outer.py", "chunk_hashes"),
]


def print_profile(path: Path, rounds: int) -> None:
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    print(f"  where peer 0 spent its CPU time, seconds per round (cProfile, {rounds} timed rounds):")
    for label, filename, function in PROFILED:
        seconds = sum(v[3] for (f, _, name), v in stats.items() if f.endswith(filename) and name == function)
        print(f"    {seconds / rounds:6.3f}  {label}")


def run_case(
    system: str,
    peers: int,
    numel: int,
    codec: str,
    rounds: int,
    *,
    verbose: bool = False,
    profile: bool = False,
    mbit: float = 0.0,
    shaper: str = "kernel",
    part_numel: int = PART_NUMEL,
) -> dict[str, float]:
    """One system's timed rounds; with ``mbit``, each peer's link is that many Mbit/s each way (``shaper``: a network
    namespace per peer shaped by the kernel, or our transport's pacing, which hivemind does not use)."""
    worker = {"swarmtrain": ours_worker, "raw": raw_worker, "hivemind": hivemind_worker}[system]
    parts = () if system == "hivemind" else (part_numel,)  # hivemind streams in parts of its own
    ctx = mp.get_context("spawn")
    with TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        net = None
        if mbit and shaper == "kernel":
            net = Network()
            stack.callback(net.close)
            links = [net.add(f"peer{i}", mbit, mbit) for i in range(peers)]
            where = [PeerLink(link.namespace, link.address) for link in links]
        else:
            where = [PeerLink(pace_mbit=mbit)] * peers
        work = Path(tmp)
        if profile and system == "swarmtrain":
            (work / "profile").touch()
        procs: list[mp.process.BaseProcess] = []
        try:
            for i in range(peers):
                procs.append(ctx.Process(target=worker, args=(i, peers, numel, codec, rounds, tmp, where[i], *parts)))
                procs[-1].start()
                if i == 0:
                    _wait_for(work / "maddr0", procs=procs)
            for i in range(peers):
                _wait_for(work / f"ready{i}", timeout=300, procs=procs)
            before = sent_bytes(net)
            (work / "go").touch()
            for i in range(peers):
                _wait_for(work / f"result{i}.json", timeout=600, procs=procs)
            after = sent_bytes(net)
        except BaseException:
            for p in procs:
                p.terminate()  # the others would wait for the dead peer's bytes until their timeouts
            raise
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
                    p.join()
        results = [json.loads((work / f"result{i}.json").read_text()) for i in range(peers)]
        cpus = [float((work / f"cpu{i}").read_text()) / rounds for i in range(peers) if (work / f"cpu{i}").exists()]
        if (work / "peer0.prof").exists():
            print_profile(work / "peer0.prof", rounds)
    walls = [max(r[k][1] for r in results) - max(r[k][0] for r in results) for k in range(rounds)]
    ok = all(r[k][2] == "applied" and r[k][3] == peers for r in results for k in range(rounds))
    if system == "swarmtrain" and verbose:
        for k in range(rounds):
            print(f"  round {k}: " + "; ".join(str(r[k][4]) for r in results), flush=True)
    resent = sum(r[k][4]["resent"] for r in results for k in range(rounds)) if system == "raw" else 0
    if resent:
        print(f"  raw ({codec}): {resent} broken stream(s) sent again in the timed rounds", flush=True)
    return {
        "wall_s": statistics.median(walls), "bytes_per_peer": (after - before) / (peers * rounds), "ok": ok,
        "cpu_s": statistics.fmean(cpus) if cpus else float("nan"),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--codecs", default="fp32,fp16")
    parser.add_argument("--systems", default="swarmtrain,raw,hivemind")
    parser.add_argument("--verbose", action="store_true", help="print where each of our rounds spent its time")
    parser.add_argument("--profile", action="store_true", help="print where our first peer spent its CPU time")
    parser.add_argument(
        "--mbit", type=float, default=0.0,
        help="each peer's link, up and down, in Mbit/s (0: loopback, unshaped)",
    )  # fmt: skip
    parser.add_argument(
        "--shaper", choices=("auto", "kernel", "transport"), default="auto",
        help="how --mbit is enforced: a network namespace per peer with the kernel's tbf (root, iproute2), or our "
        "transport's pacing (no root; not for hivemind); auto: the kernel where it can",
    )  # fmt: skip
    parser.add_argument(
        "--part-numel", type=int, default=PART_NUMEL,
        help=f"elements per streamed part (averaging.part_numel, default {PART_NUMEL:,}); the raw transfer's frames",
    )  # fmt: skip
    args = parser.parse_args()
    if args.part_numel < 1024:
        parser.error(f"--part-numel {args.part_numel} is below 1024, the least averaging.part_numel accepts")
    if args.mbit < 0:
        parser.error(f"--mbit {args.mbit:g} is negative: give a link rate in Mbit/s, or 0 for none")
    shaper = ("kernel" if kernel_available() else "transport") if args.shaper == "auto" else args.shaper
    if args.mbit and shaper == "kernel" and not kernel_available():
        parser.error("--shaper kernel needs root and the ip and tc tools (iproute2); or use --shaper transport")
    if args.mbit and shaper == "transport" and "hivemind" in args.systems.split(","):
        parser.error(
            "--shaper transport paces our transport, which hivemind does not use: add --systems swarmtrain,raw"
        )
    link = f", links of {args.mbit:g} Mbit/s each way ({shaper})" if args.mbit else ""
    print(
        f"{args.peers} peers x {args.numel:,} fp32 elements, {args.rounds} timed rounds each (after one warm-up){link}"
    )
    print(
        f"{'codec':6} {'system':10} {'wall s':>8} {'MB sent/peer':>13} {'ideal MB':>9} {'ok':>4} {'ours/it':>8} "
        f"{'CPU s/peer':>11}"
    )

    def case(system: str, codec: str) -> dict[str, float]:
        return run_case(
            system, args.peers, args.numel, codec, args.rounds, verbose=args.verbose, profile=args.profile,
            mbit=args.mbit, shaper=shaper, part_numel=args.part_numel,
        )  # fmt: skip

    for codec in args.codecs.split(","):
        payload = args.numel * (2 if codec == "fp16" else 4)
        ideal = 2 * (args.peers - 1) / args.peers * payload
        cases = {s: case(s, codec) for s in args.systems.split(",")}
        for system, c in cases.items():
            cpu = c["cpu_s"]
            ratio = (
                cases["swarmtrain"]["wall_s"] / c["wall_s"]
                if system != "swarmtrain" and "swarmtrain" in cases
                else float("nan")
            )
            print(
                f"{codec:6} {system:10} {c['wall_s']:8.3f} {c['bytes_per_peer'] / 1e6:13.1f} {ideal / 1e6:9.1f} "
                f"{'yes' if c['ok'] else 'NO':>4} {'' if ratio != ratio else f'{ratio:.2f}x':>8} "
                f"{'' if cpu != cpu else f'{cpu:.3f}':>11}",
                flush=True,
            )


if __name__ == "__main__":
    # Ctrl+C, SIGTERM (a `timeout`, kill) or SIGHUP, however the run was started: it ends its peers and removes its
    # namespaces on the way out.
    with stop_on_signals():
        main()
