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
