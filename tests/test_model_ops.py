"""Ops that real models call and the zoo found running on the CPU fallback or failing:
each native, against the CPU."""

import copy

import pytest
import torch
from conftest import assert_close, fallbacks

import torch_pjrt


@pytest.mark.parametrize("dim,shape", [(0, (6, 4, 3)), (2, (5, 4, 7)), (1, (8, 3)), (0, (9,))])
def test_weight_norm_trains_like_the_cpu(eager_mode, dim, shape, seed):
    # torch.nn.utils.parametrizations.weight_norm (wav2vec2's positional convolution)
    # reaches _weight_norm_interface and its backward on any device.
    v = torch.randn(shape, requires_grad=True)
    g_shape = [1] * len(shape)
    g_shape[dim] = shape[dim]
    g = (torch.rand(g_shape) + 0.5).requires_grad_()
    w_out = torch.randn(shape)

    def run(v, g):
        w = torch._weight_norm(v, g, dim)
        (w * w_out.to(w.device)).sum().backward()
        return w.detach(), v.grad, g.grad

    vt, gt = (t.detach().to("tpu").requires_grad_() for t in (v, g))
    torch_pjrt.reset_metrics()
    got = run(vt, gt)
    assert not fallbacks(), fallbacks()
    assert torch_pjrt.metrics()["ops"].get("aten::_weight_norm_interface", (0, 0))[0] == 1
    assert_close(got, run(v, g), atol=1e-5, rtol=1e-5)


def test_weight_norm_norms_are_float32_for_bfloat16(seed):
    v = torch.randn(4, 3, dtype=torch.bfloat16)
    g = torch.rand(4, 1, dtype=torch.bfloat16) + 0.5
    w, n = torch._weight_norm_interface(v.to("tpu"), g.to("tpu"), 0)
    ew, en = torch._weight_norm_interface(v, g, 0)
    assert (w.dtype, n.dtype) == (ew.dtype, en.dtype) == (torch.bfloat16, torch.float32)
    assert_close((w, n), (ew, en), atol=1e-2, rtol=1e-2)


def test_weight_norm_module_in_a_conv(eager_mode, seed):
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 4, 3, padding=1), dim=2)
    x = torch.randn(2, 4, 9)
    tconv = copy.deepcopy(conv).to("tpu")
    torch_pjrt.reset_metrics()
    tconv(x.to("tpu")).sum().backward()
    assert not fallbacks(), fallbacks()
    conv(x).sum().backward()
    assert_close([p.grad for p in tconv.parameters()], [p.grad for p in conv.parameters()],
                 atol=1e-5, rtol=1e-5)
