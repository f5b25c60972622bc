"""Distributed: collective bandwidth and DDP step time on tpu against Gloo on CPU tensors.

World size 2 on this host; each rank, at 1 and 2 ranks, on tpu and on the CPU, is pinned to
one core (PyTorch's CPU threads and the XLA CPU client's pool alike). Per size, all_reduce and
all_gather_into_tensor of float32 tensors on tpu (the "tpu" c10d backend: Gloo on the XLA CPU
plugin's buffers) and on CPU tensors through Gloo;
bus bandwidth as nccl-tests defines it (all_reduce: 2(n-1)/n x bytes / time, all_gather:
(n-1)/n x bytes / time). Then a DDP training step of the GPT (bench/models.py, AdamW) at 1
and 2 ranks, on tpu and on the CPU with Gloo. Medians over repetitions, with their range.
Prints ratios; no thresholds.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def _sync(device):
    if device.type == "tpu":
        torch.tpu.synchronize()


def _time(fn, device, reps):
    fn()
    _sync(device)
    out = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t)
    return out


def _pin(rank):
    """One core per rank, at every world size and on both devices: unpinned, one tpu rank
    had both cores for the XLA CPU client's pool where the CPU baseline had one thread, and
    two ranks fought over them. Every thread: importing torch already started the plugin's."""
    cores = sorted(os.sched_getaffinity(0))
    core = {cores[rank % len(cores)]}
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), core)
        except OSError:  # a thread that ended meanwhile
            pass
    torch.set_num_threads(1)


def _collectives(rank, world, store, outdir, quick):
    _pin(rank)
    import torch_pjrt  # noqa: F401

    dist.init_process_group("cpu:gloo,tpu:tpu", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    torch.tpu.set_device(rank)
    res = {}
    for size in SIZES[:4] if quick else SIZES:
        n = size // 4
        reps = 3 if size >= 16 << 20 else (5 if quick else 10)
        for dev_name in ("tpu", "cpu"):
            dev = torch.device(dev_name, rank) if dev_name == "tpu" else torch.device("cpu")
            x = torch.randn(n, device=dev)
            out = torch.empty(n * world, device=dev)
            ar = _time(lambda x=x: dist.all_reduce(x), dev, reps)
            ag = _time(lambda x=x, out=out: dist.all_gather_into_tensor(out, x), dev, reps)
            res[f"{dev_name} all_reduce {size}"] = ar
            res[f"{dev_name} all_gather {size}"] = ag
    if rank == 0:
        with open(os.path.join(outdir, "coll.json"), "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def _ddp(rank, world, store, outdir, device, steps):
    import models
    from torch.nn.parallel import DistributedDataParallel as DDP

    _pin(rank)
    import torch_pjrt  # noqa: F401

    dist.init_process_group(init_method=f"file://{store}", rank=rank, world_size=world,
                            backend="tpu" if device == "tpu" else "gloo")
    dev = torch.device("tpu", rank) if device == "tpu" else torch.device("cpu")
    if device == "tpu":
        torch.tpu.set_device(dev)
    torch.manual_seed(0)
    model = models.GPT(256, seq_len=64).to(dev)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (8, 64)).to(dev)
    y = torch.randint(0, 256, (8, 64)).to(dev)

    def step():
        opt.zero_grad(set_to_none=True)
        out = ddp(x)
        torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()).backward()
        opt.step()

    for _ in range(3):
        step()
    _sync(dev)
    if device == "tpu":
        harness.settle()
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(4):
            step()
        _sync(dev)
        times.append((time.perf_counter() - t) / 4)
    if rank == 0:
        with open(os.path.join(outdir, f"ddp_{device}_{world}.json"), "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def _spawn(fn, world, *args):
    with tempfile.TemporaryDirectory() as d:
        out = tempfile.mkdtemp()
        mp.spawn(fn, args=(world, os.path.join(d, "store"), out, *args), nprocs=world)
        return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    world = 2
    print(f"torch.distributed on tpu, world size {world} ({harness.describe()})")
    out = _spawn(_collectives, world, a.quick)
    with open(os.path.join(out, "coll.json")) as f:
        res = json.load(f)
    print(f"{'bytes':>10} {'op':<11} {'tpu GB/s':>9} {'Gloo CPU GB/s':>14} {'tpu/Gloo':>9}")
    factor = {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world}
    for size in SIZES[:4] if a.quick else SIZES:
        for op in ("all_reduce", "all_gather"):
            t = statistics.median(res[f"tpu {op} {size}"])
            c = statistics.median(res[f"cpu {op} {size}"])
            bt, bc = factor[op] * size / t / 1e9, factor[op] * size / c / 1e9
            print(f"{size:>10} {op:<11} {bt:>9.3f} {bc:>14.3f} {bt / bc:>9.2f}")
    steps = 3 if a.quick else 8
    med = {}
    for device in ("tpu", "cpu"):
        for w in (1, 2):
            d = _spawn(_ddp, w, device, steps)
            with open(os.path.join(d, f"ddp_{device}_{w}.json")) as f:
                t = json.load(f)
            med[(device, w)] = statistics.median(t)
            print(f"DDP GPT step, {device}, {w} rank(s): {med[(device, w)] * 1e3:.1f} ms "
                  f"({min(t) * 1e3:.1f}-{max(t) * 1e3:.1f})")
    r1 = med[("tpu", 1)] / med[("cpu", 1)]
    r2 = med[("tpu", 2)] / med[("cpu", 2)]
    print(f"tpu/CPU step time: {r1:.2f}x at 1 rank, {r2:.2f}x at 2 ranks "
          f"(2 ranks / 1 rank: {r2 / r1:.2f})")


if __name__ == "__main__":
    main()
