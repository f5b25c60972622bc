"""Train a small character-level GPT on the ``tpu`` device.

    python examples/train_gpt.py                 # 1000 steps on tpu: about a minute on 2 cores
    python examples/train_gpt.py --device cpu    # the same run on PyTorch CPU, to compare
    python examples/train_gpt.py --steps 50
    torchrun --nproc-per-node 2 examples/train_gpt.py --ddp    # data parallel, 2 processes
    torchrun --nproc-per-node 2 examples/train_gpt.py --fsdp   # FSDP2: sharded parameters

The model is written with plain PyTorch (embeddings, LayerNorm, attention spelled out with
matmul/masked_fill/softmax, GELU MLP, AdamW); ``import torch_pjrt`` and ``.to("tpu")`` are
the only changes from a CPU script. Every op runs through XLA; ops without a lowering run on the
CPU and are counted, and the run ends by printing that count.

Training text: examples/data/coriolanus.txt, the opening of Shakespeare's *Coriolanus*
(public domain), as laid out in the "tiny Shakespeare" corpus.
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_pjrt  # registers the "tpu" device

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "coriolanus.txt")


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, d_model, n_heads, seq_len):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)
        # True above the diagonal: the future positions each query may not see.
        self.register_buffer(
            "future",
            torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), 1),
            persistent=False,
        )

    def attention(self, x):
        B, T, C = x.shape
        H = self.n_heads
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
        att = att.masked_fill(self.future[:T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x


class GPT(nn.Module):
    def __init__(self, vocab, d_model=128, n_heads=4, n_layers=2, seq_len=64):
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, seq_len) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx, targets):
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(data, batch, seq_len, gen):
    """Random windows of the text; drawn on the host so every device sees the same data."""
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + seq_len + 1] for s in starts.tolist()])
        yield x, y


def progress(step, steps, loss, tok_s, width=30):
    done = width * step // steps
    bar = "#" * done + "." * (width - done)
    sys.stdout.write(
        f"\rstep {step:>{len(str(steps))}}/{steps} [{bar}] loss {loss:.4f}  {tok_s:,.0f} tok/s"
    )
    sys.stdout.flush()


@torch.no_grad()
def generate(model, prompt, n, device, temperature, seed):
    """Sample ``n`` characters after ``prompt``.

    The model always sees a full ``seq_len`` window (the context, right-padded with zeros),
    and the next token is read at the context's last position: causal attention makes the
    padding invisible there, and one input shape means one compiled program per op.
    """
    gen = torch.Generator().manual_seed(seed)
    out = list(prompt)
    T = model.seq_len
    for _ in range(n):
        ctx = out[-T:]
        window = torch.zeros(1, T, dtype=torch.long)
        window[0, : len(ctx)] = torch.tensor(ctx)
        logits = model(window.to(device))[0, len(ctx) - 1]
        probs = F.softmax(logits / temperature, dim=-1).cpu()
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out[len(prompt) :]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--device", default="tpu", help="tpu (default) or cpu to compare")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", type=int, default=300, help="characters to generate at the end")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--data", default=DATA)
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel (under torchrun)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard (under torchrun)")
    args = p.parse_args()

    torch_pjrt.reset_metrics()
    rank, world = 0, 1
    if args.ddp or args.fsdp:
        import torch.distributed as dist

        torch.set_num_threads(1)  # the ranks share the host's cores
        dist.init_process_group()  # the "tpu" backend; each rank on its local tpu device
        rank, world = dist.get_rank(), dist.get_world_size()

    with open(args.data, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"text: {len(text):,} characters, vocab {len(chars)}; device {args.device}"
        + (f", {world} processes" if world > 1 else ""))

    torch.manual_seed(args.seed)  # initialize on the host: the same weights on every device
    model = GPT(len(chars), seq_len=args.seq).to(args.device)
    net = model
    if args.ddp:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
    elif args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(args.device.split(":")[0], (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    say(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")

    # Each rank draws its own batches (seeded by rank); the gradient is averaged over all.
    data_iter = batches(data, args.batch, args.seq, torch.Generator().manual_seed(args.seed + rank))
    tokens = args.batch * args.seq * world
    start = last = time.perf_counter()
    last_step = 0
    for step in range(1, args.steps + 1):
        x, y = next(data_iter)
        x, y = x.to(args.device), y.to(args.device)
        logits = net(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        # Reading the loss waits for the step; do it every few steps, not every one.
        if step % 10 == 0 or step == 1 or step == args.steps:
            value = loss.item()
            now = time.perf_counter()
            if rank == 0:
                progress(step, args.steps, value, tokens * (step - last_step) / (now - last))
            last, last_step = now, step
    elapsed = time.perf_counter() - start
    say(
        f"\ntrained {args.steps} steps in {elapsed:.1f} s ({tokens * args.steps / elapsed:,.0f} tok/s)"
    )
    if world > 1:
        import torch.distributed as dist

        if args.fsdp:
            # Generation below runs on rank 0 alone: gather the whole weights into a plain
            # model there (every rank takes part in the gathering).
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            full = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if rank == 0:
                model = GPT(len(chars), seq_len=args.seq)
                model.load_state_dict(full)
                model = model.to(args.device)
        if rank != 0:
            dist.destroy_process_group()
            return

    model.eval()
    prompt = [stoi[c] for c in "\n"]
    sample = generate(model, prompt, args.sample, args.device, args.temperature, args.seed)
    print("--- sample ---")
    print("".join(chars[i] for i in sample))
    print("--------------")

    if world > 1:
        torch.distributed.destroy_process_group()
    if args.device.startswith("tpu"):
        m = torch_pjrt.metrics()
        print(f"ops run natively: {m['native_calls']}, on the CPU fallback: {m['fallback_calls']}")
        fell_back = {name: f for name, (_, f) in m["ops"].items() if f}
        for name, count in sorted(fell_back.items(), key=lambda kv: -kv[1]):
            print(f"  fallback: {name} x{count}")


if __name__ == "__main__":
    main()
