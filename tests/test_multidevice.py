"""Tensors moving between tpu devices (the CPU plugin has 4).

`.to("tpu:j")` of a `tpu:i` tensor moves its buffer with the plugin's device-to-device copy
(`metrics()["device_to_device_bytes"]`), with dtype conversion, broadcasting and strided
sources and destinations; ops then run on the destination; an op mixing devices raises
CUDA's error; a model split over two devices trains like the CPU. scripts/test.sh runs this
file in every eager mode.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_pjrt


def d2d():
    return torch_pjrt.metrics()["device_to_device_bytes"]


def test_to_another_device_moves_the_buffer():
    a = torch.ones(3, device="tpu:1")
    before = d2d()
    b = a.to("tpu:2")
    assert b.device == torch.device("tpu", 2)
    c = b + 1
    assert c.device == torch.device("tpu", 2)
    torch.testing.assert_close(c.cpu(), torch.full((3,), 2.0))
    torch.testing.assert_close(a.cpu(), torch.ones(3))  # the source is untouched
    assert d2d() - before == 3 * 4


def test_copies_between_devices_convert_broadcast_and_stride():
    src = torch.arange(12.0).reshape(3, 4)
    s = src.to("tpu:0")
    # A strided source, converted on the way.
    got = s.t().to("tpu:3", dtype=torch.float16)
    assert got.device == torch.device("tpu", 3)
    torch.testing.assert_close(got.cpu(), src.t().half())
    # Into part of a destination on another device, broadcasting a row.
    dst = torch.zeros(4, 4, device="tpu:1")
    dst[1:3].copy_(s[0])
    expected = torch.zeros(4, 4)
    expected[1:3] = src[0]
    torch.testing.assert_close(dst.cpu(), expected)
    # A CPU source into a strided destination off device 0 (its program runs there).
    strided = torch.empty(4, 3, device="tpu:3").t()
    strided.copy_(src)
    torch.testing.assert_close(strided.cpu(), src)
    # A whole destination of another dtype.
    ints = torch.empty(3, 4, dtype=torch.int32, device="tpu:2")
    ints.copy_(s * 1.5)
    torch.testing.assert_close(ints.cpu(), (src * 1.5).int())


def test_values_written_on_one_device_arrive_on_the_other():
    """A move reads the source's latest value, also when it is still queued or deferred."""
    x = torch.zeros(1000, device="tpu:0")
    for _ in range(5):
        x.add_(1)
    y = x.to("tpu:1")
    x.add_(1)  # later writes to the source do not reach the copy
    torch.testing.assert_close(y.cpu(), torch.full((1000,), 5.0))
    torch.testing.assert_close(x.cpu(), torch.full((1000,), 6.0))


def test_an_op_mixing_devices_raises():
    a, b = torch.ones(3, device="tpu:0"), torch.ones(3, device="tpu:1")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + b


def test_device_context_steers_factories_and_programs():
    with torch.tpu.device(2):
        x = torch.ones(2, device="tpu")
        assert x.device == torch.device("tpu", 2)
        assert (x * 3).device == torch.device("tpu", 2)
    y = torch.ones(2, device="tpu:3")
    assert (y + 1).device == torch.device("tpu", 3)


class TwoStages(nn.Module):
    def __init__(self):
        super().__init__()
        self.stage1 = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.stage2 = nn.Linear(32, 4)

    def forward(self, x, dev2=None):
        h = self.stage1(x)
        return self.stage2(h if dev2 is None else h.to(dev2))


def test_two_stage_pipeline_trains_like_the_cpu():
    """Stage 1 on tpu:0, stage 2 on tpu:1: activations move forward, gradients back."""
    torch.manual_seed(0)
    cpu = TwoStages()
    tpu = copy.deepcopy(cpu)
    tpu.stage1.to("tpu:0")
    tpu.stage2.to("tpu:1")
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(10)]
    opt = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
    opt_t = torch.optim.SGD(tpu.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = F.cross_entropy(cpu(x), y)
        loss.backward()
        opt.step()
        opt_t.zero_grad()
        loss_t = F.cross_entropy(tpu(x.to("tpu:0"), "tpu:1"), y.to("tpu:1"))
        loss_t.backward()
        opt_t.step()
        assert loss_t.device == torch.device("tpu", 1)
        torch.testing.assert_close(loss_t.item(), loss.item(), rtol=1e-4, atol=0,
                                   msg=f"step {step}")
    assert tpu.stage1[0].weight.grad.device == torch.device("tpu", 0)
    for (n, p), q in zip(tpu.named_parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=n: f"{n}: {m}")
