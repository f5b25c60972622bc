"""New shapes without a compile per shape, each configuration in a fresh process with an
empty compilation cache, CPU eager measured alongside:

- greedy generation from bench/models.py's 2-layer Llama-style model with a growing
  key/value cache: the first call's time (compilation included), a second call with a prompt
  of another length, the compilations of each, the ratio to CPU eager, and the warm time
  per token once both are done (median of five generations, after generations that make
  no program hot: no background compilation runs meanwhile);
- GPT training (bench/models.py, AdamW, batch 8) for ``--steps`` steps whose sequence length
  is drawn from 16 to 256 (seeded): total time including every compilation, against CPU eager.

Configurations: Strict and DeferAndFuse, each with shape buckets and with exact programs
(DeferAndFuse with exact programs only with ``--exact-defer``: one graph per token length);
with ``--compiled``, the model's forward under ``torch.compile(backend="tpu", dynamic=True)``
too (Strict, buckets on: new lengths on bucketed per-op programs; off: a capture per length).

    python bench/dynamic.py [--tokens 128] [--steps 1000] [--runs 1] [--compiled]  # 0 skips
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from harness import describe

WORKER = r"""
import json, statistics, sys, time, torch
sys.path.insert(0, sys.argv[1])
from models import Llama
tokens, where = int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
m = Llama().eval()
a, b = torch.randint(0, 256, (1, 16)), torch.randint(0, 256, (1, 23))

def warm(gen, ids):
    times = []
    for _ in range(5):
        t = time.perf_counter(); gen(ids); times.append(time.perf_counter() - t)
    return statistics.median(times) / tokens * 1e3

if where == "cpu":
    t = time.perf_counter(); m.generate(a, tokens); first = time.perf_counter() - t
    t = time.perf_counter(); m.generate(b, tokens); second = time.perf_counter() - t
    print(json.dumps(dict(first=first, second=second,
                          warm=warm(lambda ids: m.generate(ids, tokens), a))))
    sys.exit()
import torch_pjrt
torch_pjrt.set_shape_buckets(where.endswith("buckets"))
mt = Llama().eval(); mt.load_state_dict(m.state_dict()); mt = mt.to("tpu")
if where.startswith("compiled"):
    mt.forward = torch.compile(mt.forward, backend="tpu", dynamic=True)
def run(ids):
    torch_pjrt.reset_metrics()
    t = time.perf_counter()
    out = mt.generate(ids.to("tpu"), tokens).cpu()
    dt = time.perf_counter() - t
    assert torch.equal(out, m.generate(ids, tokens)), "tokens differ from the CPU's"
    return dt, torch_pjrt.metrics()["compilations"]
(f, fc), (s, sc) = run(a), run(b)
at = a.to("tpu")
# Warm: generations until one makes no program hot (their optimized versions compile in
# the background and would run during the measurement).
for _ in range(8):
    torch_pjrt.wait_background()
    torch_pjrt.reset_metrics()
    mt.generate(at, tokens).cpu()
    torch_pjrt.wait_background()
    if torch_pjrt.metrics()["background_compilations"] == 0:
        break
w = warm(lambda ids: mt.generate(ids, tokens).cpu(), at)
print(json.dumps(dict(first=f, second=s, first_compiles=fc, second_compiles=sc, warm=w)))
"""


TRAIN = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
from models import GPT
steps, where = int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = GPT(256, seq_len=256)
dev = "cpu"
if where != "cpu":
    import torch_pjrt
    torch_pjrt.set_shape_buckets(where.endswith("buckets"))
    dev = "tpu"
    model = model.to(dev)
    if where.startswith("compiled"):
        model.forward = torch.compile(model.forward, backend="tpu", dynamic=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(1)
t0 = time.perf_counter()
for _ in range(steps):
    t = int(torch.randint(16, 257, (1,), generator=gen))
    x = torch.randint(0, 256, (8, t), generator=gen).to(dev)
    y = torch.randint(0, 256, (8, t), generator=gen).to(dev)
    opt.zero_grad(set_to_none=True)
    loss = model.loss(x, y)
    loss.backward()
    opt.step()
last = loss.item()
dt = time.perf_counter() - t0
out = dict(total=dt, loss=last)
if where != "cpu":
    out["compilations"] = torch_pjrt.metrics()["compilations"]
print(json.dumps(out))
"""

MODES = {"Strict": "0", "DeferAndFuse": "1"}


def worker(script, here, n, where, mode):
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCH_TPU_CACHE_DIR=cache,
                   TORCH_TPU_DEFER_AND_FUSE=MODES.get(mode, "0"))
        out = subprocess.run([sys.executable, "-c", script, here, str(n), where],
                             capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def span(xs, fmt):
    return fmt.format(statistics.median(xs)) + (
        f" ({fmt.format(min(xs))}-{fmt.format(max(xs))})" if len(xs) > 1 else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--train-exact", action="store_true",
                    help="also train with exact programs (one set per length: slow)")
    ap.add_argument("--exact-defer", action="store_true",
                    help="also generate in DeferAndFuse with exact programs (slow)")
    ap.add_argument("--compiled", action="store_true",
                    help="also with torch.compile(backend='tpu', dynamic=True) of the "
                         "model's forward, Strict, buckets on and off")
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    print(f"# {describe()}; {args.tokens} new tokens, prompts of 16 then 23; "
          f"median (range) over {args.runs} run(s)")
    configs = [("cpu", "CPU eager"), ("buckets", "Strict"), ("exact", "Strict"),
               ("buckets", "DeferAndFuse")]
    if args.exact_defer:
        configs.append(("exact", "DeferAndFuse"))
    compiled = [("compiled-buckets", "Strict"), ("compiled-exact", "Strict")]
    if args.compiled:
        configs += compiled
    cpu = None
    for where, mode in configs if args.tokens > 0 else ():
        rs = [worker(WORKER, here, args.tokens, where, mode) for _ in range(args.runs)]
        first, second, warm = ([r[k] for r in rs] for k in ("first", "second", "warm"))
        if where == "cpu":
            cpu = {k: statistics.median(v) for k, v in
                   (("first", first), ("second", second), ("warm", warm))}
            print(f"CPU eager: first {span(first, '{:.3f}')} s, second "
                  f"{span(second, '{:.3f}')} s, warm {span(warm, '{:.2f}')} ms/token")
            continue
        fc, sc = (rs[0][k] for k in ("first_compiles", "second_compiles"))
        print(f"tpu {mode}, {where}: first {span(first, '{:.2f}')} s ({fc} compilations, "
              f"{statistics.median(first) / cpu['first']:.0f}x CPU), second "
              f"{span(second, '{:.2f}')} s ({sc} compilations, "
              f"{statistics.median(second) / cpu['second']:.1f}x CPU), warm "
              f"{span(warm, '{:.2f}')} ms/token ({statistics.median(warm) / cpu['warm']:.1f}x "
              "CPU)")
    if args.steps <= 0:
        return
    print(f"# GPT training, {args.steps} AdamW steps, batch 8, lengths 16..256 (seeded)")
    configs = [("cpu", "CPU eager"), ("buckets", "Strict"), ("buckets", "DeferAndFuse")]
    if args.train_exact:
        configs.append(("exact", "Strict"))
    if args.compiled:
        configs += compiled
    base = None
    for where, mode in configs:
        rs = [worker(TRAIN, here, args.steps, where, mode) for _ in range(args.runs)]
        total = [r["total"] for r in rs]
        if where == "cpu":
            base = statistics.median(total)
            print(f"CPU eager: {span(total, '{:.1f}')} s (last loss {rs[0]['loss']:.4f})")
            continue
        print(f"tpu {mode}, {where}: {span(total, '{:.1f}')} s ({rs[0]['compilations']} "
              f"compilations, {statistics.median(total) / base:.2f}x CPU; last loss "
              f"{rs[0]['loss']:.4f})")


if __name__ == "__main__":
    main()
