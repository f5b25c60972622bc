"""The benchmark models (the same two the peers were measured with, see bench/eager.py).

MLP: Linear 784->512, ReLU, 512->512, ReLU, 512->10; batch 64; cross-entropy.
GPT: examples/train_gpt.py's model (token + position embeddings, 2 pre-LayerNorm blocks of
d_model 128 and 4 heads, causal attention written with matmul/masked_fill/softmax, GELU MLP
128->512->128, final LayerNorm, head to vocab 256); batch 8, sequence 64; cross-entropy.
"""

import importlib.util
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

_EXAMPLE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "examples", "train_gpt.py"
)


def _example():
    spec = importlib.util.spec_from_file_location("train_gpt", _EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GPT = _example().GPT


class ResBlock(nn.Module):
    """conv-bn-relu-conv-bn with an identity shortcut."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class CNN(nn.Module):
    """ResNet-style: conv-bn-relu stem (optionally max-pooled), 2 residual blocks, global
    average pool, linear head."""

    def __init__(self, channels=16, classes=10, pool=False):
        super().__init__()
        stem = [nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                nn.ReLU()]
        self.stem = nn.Sequential(*stem, *([nn.MaxPool2d(2)] if pool else []))
        self.blocks = nn.Sequential(ResBlock(channels), ResBlock(channels))
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))

    def loss(self, x, y):
        return F.cross_entropy(self(x), y)


def mlp():
    return nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def mlp_step(device, seed=0):
    """A function running one SGD training step of the MLP; returns the loss as a float."""
    torch.manual_seed(seed)
    model = mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 784).to(device)
    y = torch.randint(0, 10, (64,)).to(device)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def gpt_step(device, seed=0, vocab=256, batch=8, seq=64, autocast=None):
    """A function running one AdamW training step of the GPT; returns the loss as a float.
    With ``autocast`` (a dtype), the forward runs under ``torch.autocast(device, autocast)``."""
    torch.manual_seed(seed)
    model = GPT(vocab, seq_len=seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, vocab, (batch, seq)).to(device)
    y = torch.randint(0, vocab, (batch, seq)).to(device)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            loss = model.loss(x, y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


class Llama(nn.Module):
    """A Llama-style decoder (RMSNorm, rotary positions, grouped-query causal attention
    with a key/value cache grown by ``torch.cat`` like Hugging Face's dynamic cache,
    SwiGLU MLP, untied head). ``generate`` is greedy decoding."""

    def __init__(self, vocab=256, dim=128, layers=2, heads=4, kv_heads=2, hidden=344,
                 theta=10000.0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.norm1 = nn.RMSNorm(dim, eps=1e-6)
            layer.q = nn.Linear(dim, dim, bias=False)
            layer.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
            layer.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
            layer.o = nn.Linear(dim, dim, bias=False)
            layer.norm2 = nn.RMSNorm(dim, eps=1e-6)
            layer.gate = nn.Linear(dim, hidden, bias=False)
            layer.up = nn.Linear(dim, hidden, bias=False)
            layer.down = nn.Linear(hidden, dim, bias=False)
            self.layers.append(layer)
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab, bias=False)
        inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    @staticmethod
    def _rotate(x, cos, sin):
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-b, a), dim=-1) * sin

    def _run(self, ids, pos, attend):
        """The logits of ``ids`` at positions ``pos``; ``attend(i, q, k, v)`` keeps layer
        ``i``'s keys and values in its cache and returns the attention output."""
        b, t = ids.shape
        freqs = pos[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            h = layer.norm1(x)
            q = layer.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            k = layer.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = layer.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            a = attend(i, q, k, v)
            x = x + layer.o(a.transpose(1, 2).reshape(b, t, -1))
            h = layer.norm2(x)
            x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        return self.head(self.norm(x))

    def _repeat(self, kv):
        """Grouped-query attention: each key/value head serves heads // kv_heads heads."""
        return kv.repeat_interleave(self.heads // self.kv_heads, dim=1)

    def forward(self, ids, cache=None):
        """``ids`` (batch, new tokens); ``cache`` a list of (k, v) per layer or None.
        Returns the logits and the grown cache."""
        past = 0 if cache is None else cache[0][0].shape[2]
        pos = torch.arange(past, past + ids.shape[1], device=ids.device)
        new_cache = []

        def attend(i, q, k, v):
            if cache is not None:
                k = torch.cat((cache[i][0], k), dim=2)
                v = torch.cat((cache[i][1], v), dim=2)
            new_cache.append((k, v))
            return F.scaled_dot_product_attention(q, self._repeat(k), self._repeat(v),
                                                  is_causal=cache is None)

        return self._run(ids, pos, attend), new_cache

    def forward_static(self, ids, start, ks, vs):
        """``forward`` with a static cache: ``ks``/``vs`` per layer (batch, kv_heads, max_len,
        head_dim), written in place at positions ``start + [0, t)`` (``start`` a 1-element
        int64 tensor, so that every decode step has the same shapes and one compiled graph
        serves them all); attention masks the positions not written yet. Returns the logits."""
        pos = start + torch.arange(ids.shape[1], device=ids.device)
        mask = torch.arange(ks[0].shape[2], device=ids.device)[None, :] <= pos[:, None]

        def attend(i, q, k, v):
            ks[i].index_copy_(2, pos, k)
            vs[i].index_copy_(2, pos, v)
            return F.scaled_dot_product_attention(q, self._repeat(ks[i]), self._repeat(vs[i]),
                                                  attn_mask=mask)

        return self._run(ids, pos, attend)

    @torch.no_grad()
    def generate_static(self, ids, new_tokens, step=None):
        """``generate`` with a static cache of the final length; ``step`` runs
        ``forward_static`` (a ``torch.compile``d one, say)."""
        step = step or self.forward_static
        b, t = ids.shape
        shape = (b, self.kv_heads, t + new_tokens, self.head_dim)
        like = self.embed.weight
        ks = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in self.layers]
        vs = [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in self.layers]
        start = torch.zeros(1, dtype=torch.long, device=ids.device)
        logits = step(ids, start, ks, vs)
        out = [ids]
        start = start + t
        for _ in range(new_tokens):
            nxt = logits[:, -1:].argmax(-1)
            out.append(nxt)
            logits = step(nxt, start, ks, vs)
            start = start + 1
        return torch.cat(out, dim=1)

    def loss(self, ids, targets):
        logits, _ = self(ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def generate(self, ids, new_tokens):
        logits, cache = self(ids)
        out = [ids]
        for _ in range(new_tokens):
            nxt = logits[:, -1:].argmax(-1)
            out.append(nxt)
            logits, cache = self(nxt, cache)
        return torch.cat(out, dim=1)
