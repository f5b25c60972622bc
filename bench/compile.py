"""torch.compile(backend="tpu") against eager tpu (Strict, DeferAndFuse) and PyTorch's Inductor on CPU.

    python bench/compile.py             # about 3 minutes on 2 cores (cold Inductor builds dominate)
    python bench/compile.py --quick     # fewer repetitions
    python bench/compile.py --warm-caches   # reuse the usual on-disk compilation caches

Two training steps, each ending with ``loss.item()``:
  GPT: bench/models.py's GPT (examples/train_gpt.py: d_model 128, 2 layers, vocab 256),
       batch 8, sequence 64, AdamW;
  CNN: a ResNet-style CNN (conv-bn-relu stem, 2 residual blocks of conv-bn-relu-conv-bn,
       adaptive average pool, linear; 16 channels), batch 8 of 3x32x32, SGD with momentum.
Configurations: ``torch.compile(backend="tpu")`` in Strict (default) and in DeferAndFuse mode
("compile+DF": the compiled graphs' replays are calls in the pending graph, so the forward,
backward and update fuse into one program per step), eager tpu in Strict and DeferAndFuse
mode, ``torch.compile`` with PyTorch's default backend (Inductor) on the CPU, and
PyTorch CPU eager for reference. The compiled configurations compile the forward and the loss
(Dynamo + AOTAutograd give them the backward too) and the optimizer step
(``torch.compile(opt.step)``); the eager ones run everything op by op.

Each configuration runs in its own process. "first step" is that process's first step,
run while the other processes wait: the configuration's own cold start (tracing, compilation
against empty compilation caches unless --warm-caches, and the step). Then the processes take
turns, one block of BLOCK steps each, so that all configurations see the same machine load,
with a 0.1 s pause between turns (the previous process's threads, OpenMP's spinning ones
included, go idle first: without it every configuration measured 1-1.5 ms slower);
a block runs its steps back to back and ends with ``torch.tpu.synchronize()`` on tpu
(``.item()`` waits for the loss only: the optimizer update may still be queued, and must not
run in the next configuration's turn); "ms/step" is the median over the blocks after warm-up
of a block's time divided by BLOCK (warm throughput, as a training loop sees it). Ratios: the configuration's ms/step over the fastest
eager tpu mode's and over Inductor's (below 1 is faster). "loss" is the loss after the last
step: every configuration starts from the same weights and data and runs the same number of
steps, so it should agree to a few digits. No thresholds: this measures, it does not judge.
On a loaded 2-core machine PyTorch's CPU threads wait on each other; --threads 1 makes the
CPU figures steadier.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CONFIGS = {
    "tpu compile": ("tpu", "compile"),
    "tpu compile+DF": ("tpu", "compile_defer"),
    "tpu Strict": ("tpu", "strict"),
    "tpu DeferAndFuse": ("tpu", "defer"),
    "CPU Inductor": ("cpu", "compile"),
    "CPU eager": ("cpu", "eager"),
}
EAGER_TPU = ("tpu Strict", "tpu DeferAndFuse")
BLOCK = 5


def build(model_name, device, how):
    """A function running one training step on `device` and returning the loss (a float)."""
    import torch

    sys.path.insert(0, HERE)
    import models

    torch.manual_seed(0)  # weights and data made on the CPU: the same for every configuration
    if model_name == "gpt":
        vocab, batch, seq = 256, 8, 64
        model = models.GPT(vocab, seq_len=seq)
        x = torch.randint(0, vocab, (batch, seq))
        y = torch.randint(0, vocab, (batch, seq))
        make_opt = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
    else:
        model = models.CNN(16, 10)
        x = torch.randn(8, 3, 32, 32)
        y = torch.randint(0, 10, (8,))
        make_opt = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    model = model.to(device)
    x, y = x.to(device), y.to(device)
    opt = make_opt(model.parameters())
    loss_fn, opt_step = model.loss, opt.step
    if how.startswith("compile"):
        backend = "tpu" if device == "tpu" else "inductor"
        loss_fn = torch.compile(model.loss, backend=backend)
        opt_step = torch.compile(opt.step, backend=backend)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(x, y)
        loss.backward()
        opt_step()
        return loss.item()

    return step


def tpu_metrics():
    import torch_pjrt

    m = torch_pjrt.metrics()
    c = m["compile"]
    return {
        "fallbacks": m["fallback_calls"], "disk_hits": m.get("disk_hits", 0),
        "compiled_graphs": c.get("compiled_graphs", 0),
        "uncaptured": c.get("graph_breaks", 0) + c.get("eager_graphs", 0),
    }


def worker(model_name, config, threads):
    """Serves one configuration: "first" builds it and runs its first step, "block" runs
    BLOCK more; each answers one JSON line (prefixed, other output may share stdout)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    device, how = CONFIGS[config]
    if device == "tpu":
        import torch_pjrt

        if how in ("defer", "compile_defer"):
            torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE
        torch_pjrt.reset_metrics()
    step = None
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "ready":  # imports done
            res = {}
        elif cmd == "first":
            t = time.perf_counter()
            step = build(model_name, device, how)
            loss = step()
            res = {"first_ms": (time.perf_counter() - t) * 1e3, "loss": loss}
            if device == "tpu":
                res.update(tpu_metrics())
        elif cmd == "block":
            t = time.perf_counter()
            for _ in range(BLOCK):
                loss = step()
            if device == "tpu":
                torch.tpu.synchronize()
            res = {"ms": (time.perf_counter() - t) * 1e3 / BLOCK, "loss": loss}
        else:
            return
        print(REPLY + json.dumps(res), flush=True)


REPLY = "@bench@ "


class Proc:
    """A worker process and its log file (stderr and stray stdout)."""

    def __init__(self, model_name, config, threads, env, log):
        self.log = log
        self.p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker",
             json.dumps([model_name, config, threads])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
        )
        self.error = None

    def ask(self, cmd):
        if self.error:
            return None
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        for line in self.p.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        self.log.flush()
        with open(self.log.name) as f:
            lines = f.read().strip().splitlines() or ["no output"]
        self.error = lines[-1][:100]
        return None

    def close(self):
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.close()
        except OSError:
            pass
        self.p.wait()


def cache_env(base, name):
    """Environment pointing every compilation cache at empty directories under `base`."""
    env = dict(os.environ)
    d = os.path.join(base, name.replace(" ", "_"))
    env["TORCH_TPU_CACHE_DIR"] = os.path.join(d, "tpu")
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(d, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(d, "triton")
    return env


def measure(model_name, warmup, reps, threads, tmp, warm_caches):
    """{config: result}: first steps one process at a time, then warm steps in turns."""
    procs = {}
    try:
        for config in CONFIGS:
            env = dict(os.environ) if warm_caches else cache_env(tmp, f"{model_name}-{config}")
            log = open(os.path.join(tmp, f"{model_name}-{config.replace(' ', '_')}.log"), "w")
            procs[config] = Proc(model_name, config, threads, env, log)
        for proc in procs.values():
            proc.ask("ready")  # no process is still importing while another one is timed
        res = {c: proc.ask("first") or {} for c, proc in procs.items()}
        times = {c: [] for c in CONFIGS}
        for i in range(warmup + reps):
            for c, proc in procs.items():
                # The previous turn's idle threads (OpenMP spins after a parallel region)
                # must not take the cores from this one.
                time.sleep(0.1)
                r = proc.ask("block")
                if r and i >= warmup:
                    times[c].append(r["ms"])
                    res[c]["loss"] = r["loss"]
        for c, proc in procs.items():
            if times[c]:
                res[c]["ms"] = statistics.median(times[c])
            if proc.error:
                res[c]["error"] = proc.error
        return res
    finally:
        for proc in procs.values():
            proc.close()
            proc.log.close()


def fmt_ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--warm-caches", action="store_true",
                   help="use the usual compilation cache directories instead of empty ones")
    p.add_argument("--models", default="gpt,cnn", help="comma-separated: gpt, cnn")
    p.add_argument("--threads", type=int, default=0,
                   help="PyTorch CPU threads in every process (default: PyTorch's own choice)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(*json.loads(a.worker))
        return
    warmup, reps = (1, 5) if a.quick else (2, 15)

    import torch

    load = os.getloadavg()[0]
    print(
        f"torch {torch.__version__}, {a.threads or torch.get_num_threads()} CPU threads; "
        f"load average {load:.1f} on {os.cpu_count()} cores; "
        f"{'warm' if a.warm_caches else 'empty'} compilation caches; "
        f"{warmup} warm-up blocks, median of {reps} blocks of {BLOCK} steps taken in turns"
    )
    header = (
        f"{'step':<5} {'config':<17} {'first step ms':>13} {'ms/step':>9} {'steps/s':>8} "
        f"{'vs eager tpu':>12} {'vs Inductor':>11} {'loss':>9}  notes"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory(prefix="bench_compile_") as tmp:
        for model_name in a.models.split(","):
            res = measure(model_name, warmup, reps, a.threads, tmp, a.warm_caches)
            eager = [res[c]["ms"] for c in EAGER_TPU if "ms" in res[c]]
            best_eager = min(eager) if eager else None
            ind = res["CPU Inductor"].get("ms")
            for config, r in res.items():
                if "ms" not in r:
                    print(f"{model_name:<5} {config:<17} failed: {r.get('error')}", flush=True)
                    continue
                notes = []
                if r.get("fallbacks"):
                    notes.append(f"{r['fallbacks']} CPU fallbacks in the first step")
                if r.get("disk_hits"):
                    notes.append(f"{r['disk_hits']} programs from disk")
                if config.startswith("tpu compile"):
                    notes.append(f"{r['compiled_graphs']} graphs compiled")
                    if r["uncaptured"]:
                        notes.append(f"{r['uncaptured']} graphs not captured (run op by op)")
                print(
                    f"{model_name:<5} {config:<17} {r['first_ms']:>13.0f} {r['ms']:>9.2f} "
                    f"{1e3 / r['ms']:>8.1f} {fmt_ratio(r['ms'], best_eager):>12} "
                    f"{fmt_ratio(r['ms'], ind):>11} {r['loss']:>9.5f}  {'; '.join(notes)}",
                    flush=True,
                )
    end = os.getloadavg()[0]
    print(f"load average at the end: {end:.1f}")
    if max(load, end) >= (os.cpu_count() or 1):
        print(f"note: load average reached {max(load, end):.1f}: other processes shared the cores")


if __name__ == "__main__":
    main()
