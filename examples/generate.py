"""Text generation on the ``tpu`` device with a Hugging Face model and ``model.generate()``.

    python examples/generate.py                   # train a tiny Llama on Coriolanus, then generate
    python examples/generate.py --static          # the same with cache_implementation="static"
    python examples/generate.py --check           # also generate on the CPU: the tokens must agree
    python examples/generate.py --sample          # sampled (top-k, seeded) instead of greedy

The model is transformers' ``LlamaForCausalLM`` built from a small ``LlamaConfig`` (no
download), trained on the device for ``--train-steps`` AdamW steps on the characters of
examples/data/coriolanus.txt so that it writes something like English, then asked for
``--tokens`` new characters with a progress bar and tokens/s. Needs the ``zoo`` extra
(transformers).
"""

import argparse
import copy
import os
import sys
import time

import torch

import torch_pjrt  # registers the "tpu" device

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "coriolanus.txt")


def build(vocab, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, pad_token_id=0, bos_token_id=None,
                      eos_token_id=None)
    return LlamaForCausalLM(cfg)


def train(model, data, steps, device, seq=64, batch=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + seq] for s in starts]).to(device)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"\rtraining step {step + 1}/{steps} loss {loss.item():.3f}", end="", flush=True)
    print()
    return model.eval()


class Progress:
    """A transformers streamer that draws a progress bar and the rate."""

    def __init__(self, total, width=30):
        self.total, self.width, self.n, self.t0, self.first = total, width, -1, None, None

    def put(self, ids):
        self.n += 1  # the first call carries the prompt
        if self.n == 0:
            self.t0 = time.perf_counter()
            return
        if self.n == 1:
            self.first = time.perf_counter() - self.t0
        done = int(self.width * self.n / self.total)
        rate = self.n / max(time.perf_counter() - self.t0, 1e-9)
        bar = "#" * done + "." * (self.width - done)
        print(f"\r[{bar}] {self.n}/{self.total} tokens, {rate:.1f} tokens/s", end="", flush=True)

    def end(self):
        print()


def generate(model, prompt, args, device, show=True):
    ids = prompt.to(device)[None]
    kw = {"max_new_tokens": args.tokens, "do_sample": args.sample, "pad_token_id": 0}
    if args.sample:
        kw.update(top_k=10, temperature=0.8)
        torch.manual_seed(args.seed)
    if args.static:
        kw["cache_implementation"] = "static"
    bar = Progress(args.tokens) if show else None
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, streamer=bar, **kw)
    seconds = time.perf_counter() - t0
    return out[0, ids.shape[1]:].cpu(), seconds, bar and bar.first


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="tpu")
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt", default="MENENIUS:\n")
    p.add_argument("--static", action="store_true", help='cache_implementation="static"')
    p.add_argument("--sample", action="store_true", help="top-k sampling (seeded), not greedy")
    p.add_argument("--check", action="store_true", help="generate on the CPU too and compare")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    text = open(DATA).read()
    chars = sorted(set(text))
    stoi = {c: i + 1 for i, c in enumerate(chars)}  # 0 is padding
    data = torch.tensor([stoi[c] for c in text])
    device_model = build(len(chars) + 1, args.seed).to(args.device)
    train(device_model, data, args.train_steps, args.device)
    prompt = torch.tensor([stoi[c] for c in args.prompt if c in stoi])

    torch_pjrt.reset_metrics()
    tokens, seconds, first = generate(device_model, prompt, args, args.device)
    m = torch_pjrt.metrics()
    print(args.prompt + "".join(chars[i - 1] if i > 0 else "" for i in tokens.tolist()))
    print(f"{len(tokens)} tokens in {seconds:.2f} s ({len(tokens) / seconds:.1f} tokens/s; "
          f"first token after {first or 0:.2f} s) on {args.device}, "
          f"{'static' if args.static else 'dynamic'} cache, {m['compilations']} compilations, "
          f"{m['fallback_calls']} CPU fallback calls")
    if args.check:
        model = copy.deepcopy(device_model).to("cpu")
        want, cpu_seconds, _ = generate(model, prompt, args, "cpu", show=False)
        same = torch.equal(want, tokens)
        print(f"CPU: {cpu_seconds:.2f} s; tokens {'agree' if same else 'DIFFER'}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
