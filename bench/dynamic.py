"""New shapes without a compile per shape: greedy generation from bench/models.py's
2-layer Llama-style model with a growing key/value cache, each configuration in a fresh
process with an empty compilation cache, CPU eager measured alongside.

    python bench/dynamic.py [--tokens 128] [--runs 1]

Prints, per configuration, the first call's time (compilation included), a second call with
a prompt of another length, the compilations of each, and the ratio to CPU eager.
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    print(f"# {describe()}; {args.tokens} new tokens, prompts of 16 then 23")
    for where in ("cpu", "buckets", "exact"):
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


if __name__ == "__main__":
    main()
