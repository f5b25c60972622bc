"""Shared by the benchmarks: what a figure was measured on (processor, cores, load) and
how a configuration runs in a fresh process."""

import os


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown processor"


def describe():
    load = os.getloadavg()[0]
    return f"{cpu_model()}, {os.cpu_count()} cores, load average {load:.1f}"


def primed_run(cmd, warmup, reps):
    """Runs ``cmd + [warmup, reps]`` in a fresh process after an unmeasured one with no
    measured steps: the same warm-up steps fill the disk compilation cache first, so the
    measured process runs what it measures instead of compiling it. Returns the JSON line
    the worker printed last."""
    import json
    import subprocess

    subprocess.run(cmd + [str(warmup), "0"], capture_output=True, text=True, check=True)
    out = subprocess.run(cmd + [str(warmup), str(reps)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def settle():
    """The steady state: programs that became hot during the warm-up get their optimized
    versions (compiled in the background) before anything is measured."""
    import sys

    if "torch_pjrt" in sys.modules:
        sys.modules["torch_pjrt"].wait_background()


def block_times(step, sync, warmup, reps, block):
    """Warm throughput: ``warmup`` steps, then ``reps`` blocks of ``block`` back-to-back steps
    each ending with ``sync()``; returns ms per step of each block."""
    import time

    for _ in range(warmup):
        step()
    sync()
    settle()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(block):
            step()
        sync()
        times.append((time.perf_counter() - t) / block * 1e3)
    return times
