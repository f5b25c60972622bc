"""``torch.tpu.profiler``: ``torch.profiler.profile`` plus what ran on the device.

``torch.profiler.profile(activities=[..., ProfilerActivity.PrivateUse1])`` shows the device's
program runs through the shim's Kineto plugin (``shim/kineto.cpp``). Two more ways:

- ``torch.tpu.profiler.profile(...)`` takes ``torch.profiler.profile``'s arguments and
  records, besides the host's ATen calls, every program the runtime runs: op or graph name,
  device, stream, when it was queued, when it started and finished on the device, and how
  its program was obtained (cache hit, compiled, loaded from disk, with the seconds).
  ``export_chrome_trace`` writes one trace where the device's runs sit on their own tracks
  (a process per tpu device, a thread per stream; open it in Perfetto), and
  ``device_table()`` sums device time per op.
- ``torch.autograd.profiler.profile(use_device="tpu", use_kineto=False)``: PyTorch's own
  per-op device time (``Self TPU``/``TPU total`` columns of ``key_averages()``), from
  markers the shim queues around each op on its stream.
"""

import collections
import json

import torch

from . import _C

__all__ = ["profile"]

_PID_BASE = 1 << 20  # process ids of the device tracks, away from real pids


class profile:
    """``torch.profiler.profile`` with the tpu device's program runs (see the module doc)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("activities", [torch.profiler.ProfilerActivity.CPU])
        self.profiler = torch.profiler.profile(*args, **kwargs)
        self.device_events = []

    def __enter__(self):
        torch.tpu.synchronize()
        _C.trace_start()
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            torch.tpu.synchronize()
        finally:
            self.profiler.__exit__(*exc)
            self._collect()
        return False

    def start(self):
        return self.__enter__()

    def stop(self):
        self.__exit__(None, None, None)

    def _collect(self):
        epoch = _C.trace_epoch_wall_ns()
        self.device_events = [
            {"name": n, "device": d, "stream": s, "queued_ns": epoch + q, "start_ns": epoch + b,
             "end_ns": epoch + e, "program": kind, "program_seconds": secs}
            for n, d, s, q, b, e, kind, secs in _C.trace_stop()
        ]

    def __getattr__(self, name):
        return getattr(self.profiler, name)

    def device_averages(self):
        """Per op or graph name: calls, device time (total and mean, ms), mean queue time
        (ms), compilations and their seconds, loads from disk, cache hits."""
        rows = collections.OrderedDict()
        for ev in self.device_events:
            r = rows.setdefault(ev["name"], collections.Counter())
            r["calls"] += 1
            r["device_ms"] += (ev["end_ns"] - ev["start_ns"]) / 1e6
            r["queue_ms"] += (ev["start_ns"] - ev["queued_ns"]) / 1e6
            r[ev["program"]] += 1
            r["compile_s"] += ev["program_seconds"] if ev["program"] == "compiled" else 0.0
        return rows

    def device_table(self, row_limit=20):
        rows = sorted(self.device_averages().items(), key=lambda kv: -kv[1]["device_ms"])
        total = sum(r["device_ms"] for _, r in rows) or 1.0
        head = (f"{'program':<48} {'calls':>6} {'device ms':>10} {'%':>6} {'avg ms':>8} "
                f"{'queue ms':>9} {'compiled':>9} {'disk':>5} {'hits':>6}")
        lines = [head, "-" * len(head)]
        for name, r in rows[:row_limit]:
            lines.append(
                f"{name[:48]:<48} {r['calls']:>6} {r['device_ms']:>10.3f} "
                f"{100 * r['device_ms'] / total:>5.1f}% {r['device_ms'] / r['calls']:>8.3f} "
                f"{r['queue_ms'] / r['calls']:>9.3f} {r['compiled']:>9} "
                f"{r['loaded from disk']:>5} {r['cache hit']:>6}")
        return "\n".join(lines)

    def export_chrome_trace(self, path):
        """The host trace of ``torch.profiler`` with the device's runs added as tracks."""
        self.profiler.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        base_ns = int(trace.get("baseTimeNanoseconds", 0))
        events = trace.setdefault("traceEvents", [])
        seen = set()
        for ev in self.device_events:
            pid, tid = _PID_BASE + ev["device"], ev["stream"]
            if (pid, tid) not in seen:
                seen.add((pid, tid))
                events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                               "args": {"name": f"tpu:{ev['device']}"}})
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": f"stream {tid}"}})
            events.append({
                "ph": "X", "cat": "tpu_program", "name": ev["name"], "pid": pid, "tid": tid,
                "ts": (ev["start_ns"] - base_ns) / 1e3,
                "dur": (ev["end_ns"] - ev["start_ns"]) / 1e3,
                "args": {"queued (us before start)": (ev["start_ns"] - ev["queued_ns"]) / 1e3,
                         "program": ev["program"],
                         "program seconds": ev["program_seconds"]},
            })
        with open(path, "w") as f:
            json.dump(trace, f)
