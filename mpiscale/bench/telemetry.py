"""What telemetry costs a job: the same dictionary-learning run with telemetry off, to a file, to a broker, and
to a broker that never answers, in the same process, at the default interval.

The broker is a real mosquitto started on a free loopback port (skipped where
it is not installed). The silent broker is a socket that accepts connections
and never says a word: every connection attempt waits for its timeout, then
backs off, then the circuit breaker pauses. Each variant runs ``repeats``
times, in turn; the table gives the median and the fastest wall time, and the
slowdowns against "off" measured in the same run. Runs on this shared machine
spread by several percent, more than the cost sought, so the bench also
times what a job's lifecycle adds to every step (the progress update and the
steering point where ranks agree on requests) in a job of empty steps under
``run_lifecycle``, with telemetry off and on, and gives it as a share of a
learning iteration.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path

from ..dictlearn.config import DictLearnConfig
from ..dictlearn.learner import learn
from ..jobs import Ended, Plan, Step, observed, run_lifecycle
from ..runtime import ActorSystem, run
from .dictlearn import planted_data
from .report import table, write_json

SETTING = {"atoms": 128, "features": 48, "sparsity": 6, "samples": 8_000}
ITERATIONS = {"full": 6000, "quick": 60}  # the full runs take about 9 s each on 2 ranks of this 2-core VM
EMPTY_STEPS = {"full": 500_000, "quick": 2_000}  # the full loop spans a few reporting intervals
#: The silent broker's accepted connections stay open until the process ends: closing them would wake the
#: MQTT clients that gave up on them (aiomqtt then logs a cancelled callback), after the measured runs.
_HELD: list[socket.socket] = []


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def _mosquitto(directory: Path):
    """A broker on a free port (its address), or None where mosquitto is not installed."""
    if shutil.which("mosquitto") is None:
        yield None
        return
    port = _free_port()
    config = directory / "mosquitto.conf"
    config.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    process = subprocess.Popen(["mosquitto", "-c", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


@contextlib.contextmanager
def _silent_broker():
    """A listener that accepts connections and never answers (its address)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                _HELD.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        server.close()


async def run_telemetry_bench(system: ActorSystem, json_path: str, workdir: str, quick: bool = False) -> dict | None:
    """Each variant ``repeats`` times in turn (collective); rank 0 prints the table and writes JSON."""
    directory = Path(workdir)
    data = await planted_data(system, directory, "bench-telemetry-data.h5", SETTING)
    repeats = 2 if quick else 5
    with contextlib.ExitStack() as stack:
        brokers: dict[str, str | None] = {"broker": None, "silent broker": None}
        if system.rank == 0:
            brokers = {"broker": stack.enter_context(_mosquitto(directory)),
                       "silent broker": stack.enter_context(_silent_broker())}  # fmt: skip
        brokers = await system.world.bcast(brokers, 0)  # type: ignore[assignment]
        variants = {"off": {"MPISCALE_TELEMETRY": "0"}, "file": {}}
        variants |= {name: {"MPISCALE_BROKER": address} for name, address in brokers.items() if address}
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        await _one_run(system, directory, data, variants["off"], quick, "warm-up")  # compiles the kernels
        for repeat in range(repeats):
            for name, environment in variants.items():
                seconds[name].append(await _one_run(system, directory, data, environment, quick, f"{repeat}-{name}"))
    per_step = {name: await _step_cost(system, directory, environment, quick) for name, environment in
                (("off", variants["off"]), ("file", variants["file"]))}  # fmt: skip
    if system.rank != 0:
        return None
    median = {name: statistics.median(values) for name, values in seconds.items()}
    fastest = {name: min(values) for name, values in seconds.items()}
    rows = [[name, median[name], median[name] / median["off"] - 1, fastest[name], fastest[name] / fastest["off"] - 1]
            for name in variants]  # fmt: skip
    print(f"telemetry's cost to a dictionary-learning run on {system.size} ranks, {repeats} runs each (s):")
    print(table(["telemetry", "median", "slowdown", "fastest", "slowdown"], rows))
    if "broker" not in median:
        print("(mosquitto is not installed: no broker row)")
    iteration = fastest["off"] / ITERATIONS["quick" if quick else "full"]
    added = per_step["file"] - per_step["off"]
    print(f"per step: {1e6 * per_step['off']:.2f} us without telemetry, {1e6 * per_step['file']:.2f} us with it "
          f"(to its file): {1e6 * added:.2f} us added, {added / iteration:.3%} of a learning iteration "
          f"({1e3 * iteration:.2f} ms)")  # fmt: skip
    results = {
        "seconds": seconds,
        "median_s": median,
        "fastest_s": fastest,
        "slowdown": {n: median[n] / median["off"] - 1 for n in median},
        "slowdown_fastest": {n: fastest[n] / fastest["off"] - 1 for n in fastest},
        "empty_step_s": per_step,
        "added_per_iteration": added / iteration,
    }
    write_json(json_path, "telemetry", system.size, results)
    return results


@dataclass
class _EmptySteps:
    """A job whose steps do nothing: what the lifecycle (progress, steering) adds to every step of a real one."""

    plan: Plan

    async def restore(self) -> int:
        return 0

    async def steps(self, start: int) -> AsyncGenerator[Step, None]:
        step = Step("", 1.0, {"work": 0.0})
        for _ in range(start, self.plan.total):
            yield step

    def save(self, done: int) -> None:
        raise AssertionError("an empty job keeps no checkpoints")

    def close_checkpoints(self) -> None:
        return None

    async def finish(self, ended: Ended) -> dict:
        return {"steps": ended.done}

    def release(self) -> None:
        pass


async def _step_cost(system: ActorSystem, directory: Path, environment: dict[str, str], quick: bool) -> float:
    """Seconds per empty step of a job under ``run_lifecycle`` (progress update, steering) with ``environment``."""
    _set_environment(environment)
    steps = EMPTY_STEPS["quick" if quick else "full"]
    job = _EmptySteps(Plan("step", "items", steps, progress_every=None))

    async def loop() -> float:
        await system.world.barrier()
        started = time.perf_counter()
        await run_lifecycle(system, "bench", lambda: job)
        return time.perf_counter() - started

    elapsed = await observed(system, "bench", str(directory / "bench-telemetry-steps.h5"), loop)
    return elapsed / steps


def _set_environment(environment: dict[str, str]) -> None:
    for name in ("MPISCALE_TELEMETRY", "MPISCALE_BROKER"):
        os.environ.pop(name, None)
    os.environ.update(environment)


async def _one_run(
    system: ActorSystem, directory: Path, data: str, environment: dict[str, str], quick: bool, tag: str
) -> float:
    """Seconds of one learning run under telemetry with ``environment`` (the slowest rank's)."""
    _set_environment(environment)
    config = DictLearnConfig(
        data=f"{data}:/signals",
        atoms=SETTING["atoms"],
        sparsity=SETTING["sparsity"],
        iterations=ITERATIONS["quick" if quick else "full"],
        out=str(directory / f"bench-telemetry-{tag}.h5"),
        progress_every=0,
    )
    await system.world.barrier()
    started = time.perf_counter()
    await observed(system, "dictlearn", config.out, lambda: learn(system, config))
    elapsed = time.perf_counter() - started
    import numpy as np

    slowest = await system.world.allreduce(np.array([elapsed]), op="max")
    return float(slowest[0])


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench ...``: the options parsed, the benchmark run, its table printed and its JSON written."""
    run(lambda system: run_telemetry_bench(system, args.json, args.dir, quick=args.quick))
    return 0
