"""New shapes without a compile per shape, each configuration in a fresh process with an
empty compilation cache, CPU eager measured alongside:

- greedy generation from bench/models.py's 2-layer Llama-style model with a growing
  key/value cache: the first call's time (compilation included), a second call with a prompt
  of another length, the compilations of each, the ratio to CPU eager;
- GPT training (bench/models.py, AdamW, batch 8) for ``--steps`` steps whose sequence length
  is drawn from 16 to 256 (seeded): total time including every compilation, against CPU eager.

    python bench/dynamic.py [--tokens 128] [--steps 1000] [--runs 1]   # 0 skips a part
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from harness import describe

WORKER = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
from models import Llama
tokens, where = int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
m = Llama().eval()
a, b = torch.randint(0, 256, (1, 16)), torch.randint(0, 256, (1, 23))
if where == "cpu":
    t = time.perf_counter(); m.generate(a, tokens); first = time.perf_counter() - t
    t = time.perf_counter(); m.generate(b, tokens); second = time.perf_counter() - t
    print(json.dumps(dict(first=first, second=second)))
    sys.exit()
import torch_pjrt
torch_pjrt.set_shape_buckets(where == "buckets")
mt = Llama().eval(); mt.load_state_dict(m.state_dict()); mt = mt.to("tpu")
def run(ids):
    torch_pjrt.reset_metrics()
    t = time.perf_counter()
    out = mt.generate(ids.to("tpu"), tokens).cpu()
    dt = time.perf_counter() - t
    assert torch.equal(out, m.generate(ids, tokens)), "tokens differ from the CPU's"
    return dt, torch_pjrt.metrics()["compilations"]
(f, fc), (s, sc) = run(a), run(b)
print(json.dumps(dict(first=f, second=s, first_compiles=fc, second_compiles=sc)))
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
    torch_pjrt.set_shape_buckets(where == "buckets")
    dev = "tpu"
    model = model.to(dev)
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--train-exact", action="store_true",
                    help="also train with exact programs (one set per length: slow)")
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    print(f"# {describe()}; {args.tokens} new tokens, prompts of 16 then 23")
    for where in ("cpu", "buckets", "exact") if args.tokens > 0 else ():
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCH_TPU_CACHE_DIR=cache)
                out = subprocess.run(
                    [sys.executable, "-c", WORKER, here, str(args.tokens), where],
                    capture_output=True, text=True, check=True, env=env,
                )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            if where == "cpu":
                cpu = r
                print(f"cpu eager: first {r['first']:.3f} s, second {r['second']:.3f} s")
                continue
            print(
                f"tpu Strict, {where}: first {r['first']:.2f} s ({r['first_compiles']} "
                f"compilations, {r['first'] / cpu['first']:.0f}x CPU), second "
                f"{r['second']:.2f} s ({r['second_compiles']} compilations, "
                f"{r['second'] / cpu['second']:.1f}x CPU)"
            )
    if args.steps <= 0:
        return
    print(f"# GPT training, {args.steps} AdamW steps, batch 8, lengths 16..256 (seeded)")
    configs = ("cpu", "buckets") + (("exact",) if args.train_exact else ())
    for where in configs:
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCH_TPU_CACHE_DIR=cache)
                out = subprocess.run(
                    [sys.executable, "-c", TRAIN, here, str(args.steps), where],
                    capture_output=True, text=True, check=True, env=env,
                )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            if where == "cpu":
                base = r["total"]
                print(f"cpu eager: {r['total']:.1f} s (last loss {r['loss']:.4f})")
                continue
            print(
                f"tpu Strict, {where}: {r['total']:.1f} s ({r['compilations']} compilations, "
                f"{r['total'] / base:.2f}x CPU; last loss {r['loss']:.4f})"
            )


if __name__ == "__main__":
    main()
