"""What a figure was measured on: the processor, its cores and the load at the start."""

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
