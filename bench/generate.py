"""Text generation speed: prefill and decode tokens/s of bench/models.py's 2-layer
Llama-style model (greedy, prompt of 16, batch 1 and 8), warm, against CPU eager and CPU
Inductor, each configuration in a fresh process:

- CPU eager: ``Llama.generate`` (key/value cache grown by ``torch.cat``, as Hugging Face's
  dynamic cache);
- CPU Inductor: ``Llama.generate_static`` (a static cache written in place at a position
  tensor, so one graph serves every decode step) with ``torch.compile`` (default backend);
- tpu Strict, tpu DeferAndFuse: ``Llama.generate`` eager;
- tpu Strict, static cache: ``Llama.generate_static`` eager;
- tpu compiled: ``Llama.generate_static`` with ``torch.compile(backend="tpu")``.

Each process generates twice unmeasured (compilation, caches, the background compiles of
hot programs), then ``--runs`` times: a
prefill alone (the prompt's forward and its first token read back) and a whole generation
(read back at the end). Decode tokens/s = batch * new tokens / (generation - prefill).
Figures are medians with the range over the runs; "x CPU eager" and "x CPU Inductor" are
decode speed over theirs (above 1 is faster). Tokens are checked against the CPU's.

    python bench/generate.py [--tokens 64] [--runs 5] [--batch 1 8]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from harness import describe, settle

HERE = os.path.dirname(os.path.abspath(__file__))

CONFIGS = {
    "CPU eager": ("cpu", "eager"),
    "CPU Inductor": ("cpu", "compile"),
    "tpu Strict": ("tpu", "strict"),
    "tpu DeferAndFuse": ("tpu", "defer"),
    "tpu Strict, static cache": ("tpu", "static"),
    "tpu compiled, static cache": ("tpu", "compile"),
}
MODE_ENV = {how: {"TORCH_TPU_DEFER_AND_FUSE": "1" if how == "defer" else "0"}
            for how in ("strict", "defer", "static", "compile")}


def worker(device, how, batch, prompt, tokens, runs):
    import time

    import torch

    sys.path.insert(0, HERE)
    import models

    torch.manual_seed(0)
    cpu = models.Llama().eval()
    ids = torch.randint(0, 256, (batch, prompt))
    want = cpu.generate(ids, tokens)
    if device == "tpu":
        import torch_pjrt  # noqa: F401 - registers the device
    model = models.Llama().eval()
    model.load_state_dict(cpu.state_dict())
    model = model.to(device)
    dev_ids = ids.to(device)
    static = how in ("static", "compile")
    step = None
    if how == "compile":
        kw = {"backend": "tpu"} if device == "tpu" else {}
        step = torch.compile(model.forward_static, **kw)

    def generate():
        if static:
            return model.generate_static(dev_ids, tokens, step=step).cpu()
        return model.generate(dev_ids, tokens).cpu()

    @torch.no_grad()
    def prefill():
        if static:
            shape = (batch, model.kv_heads, prompt + tokens, model.head_dim)
            ks = [torch.zeros(shape, device=device) for _ in model.layers]
            vs = [torch.zeros(shape, device=device) for _ in model.layers]
            start = torch.zeros(1, dtype=torch.long, device=device)
            logits = (step or model.forward_static)(dev_ids, start, ks, vs)
        else:
            logits, _ = model(dev_ids)
        return logits[:, -1].argmax(-1).cpu()

    got = generate()
    prefill()
    generate()
    settle()  # hot programs' optimized versions, compiled in the background
    assert torch.equal(got, want), "tokens differ from the CPU's"
    pre, gen = [], []
    for _ in range(runs):
        t = time.perf_counter()
        prefill()
        pre.append(time.perf_counter() - t)
        t = time.perf_counter()
        generate()
        gen.append(time.perf_counter() - t)
    print(json.dumps({"prefill": pre, "generate": gen}))


def stats(xs):
    return statistics.median(xs), min(xs), max(xs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    p.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        device, how, *nums = args.worker
        worker(device, how, *map(int, nums))
        return
    print(f"# bench/generate.py: {describe()}")
    print(f"# 2-layer Llama-style model (bench/models.py), prompt {args.prompt}, "
          f"{args.tokens} new tokens, greedy; median [range] over {args.runs} runs, warm")
    for batch in args.batch:
        rows = {}
        for name, (device, how) in CONFIGS.items():
            env = dict(os.environ, **MODE_ENV.get(how if device == "tpu" else "", {}))
            cmd = [sys.executable, __file__, "--worker", device, how, str(batch),
                   str(args.prompt), str(args.tokens), str(args.runs)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                rows[name] = None
                print(f"{name}: failed\n{out.stderr[-2000:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            pre = [batch * args.prompt / t for t in r["prefill"]]
            dec = [batch * args.tokens / max(g - p, 1e-9)
                   for g, p in zip(r["generate"], r["prefill"], strict=True)]
            rows[name] = (stats(pre), stats(dec))
        print(f"\nbatch {batch}")
        print(f"{'configuration':28s} {'prefill tok/s':>24s} {'decode tok/s':>24s} "
              f"{'decode, x CPU eager':>20s} {'x CPU Inductor':>16s}")
        base = rows.get("CPU eager")
        ind = rows.get("CPU Inductor")
        for name, row in rows.items():
            if row is None:
                print(f"{name:28s} failed")
                continue
            (pm, plo, phi), (dm, dlo, dhi) = row
            vs_eager = f"{dm / base[1][0]:.2f}x" if base else "-"
            vs_ind = f"{dm / ind[1][0]:.2f}x" if ind else "-"
            print(f"{name:28s} {pm:9.0f} [{plo:5.0f}-{phi:5.0f}] "
                  f"{dm:9.0f} [{dlo:5.0f}-{dhi:5.0f}] {vs_eager:>20s} {vs_ind:>16s}")
    print(f"\n# load after the run: {describe()}")


if __name__ == "__main__":
    main()
