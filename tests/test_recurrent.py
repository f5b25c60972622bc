"""Recurrent layers on tpu: nn.LSTM/GRU and their cells run PyTorch's fused cell kernels
(`_thnn_fused_lstm_cell`, `_thnn_fused_gru_cell` and their backward ops) on an accelerator,
which the CPU has no kernel for; the CPU runs the unfused cell, the oracle here."""

import copy

import pytest
import torch
from conftest import assert_close, fallbacks

import torch_pjrt


def _train_step(model, x, h=None):
    out = model(x) if h is None else model(x, h)
    y, state = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
    leaves = [y] + (list(state) if isinstance(state, tuple) else [] if state is None else [state])
    loss = sum((t * torch.linspace(-1, 1, t.numel(), device=t.device).view_as(t)).sum()
               for t in leaves)
    loss.backward()
    return [t.detach() for t in leaves], [p.grad for p in model.parameters()], x.grad


CASES = [
    ("lstm", dict(num_layers=2)),
    ("lstm", dict(num_layers=1, bias=False, batch_first=True)),
    ("lstm", dict(num_layers=2, bidirectional=True, proj_size=3)),
    ("gru", dict(num_layers=2, bidirectional=True)),
    ("gru", dict(num_layers=1, bias=False, batch_first=True)),
]


@pytest.mark.parametrize("kind,kw", CASES, ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}{int(x)}" for k, x in v.items()))
def test_rnn_layers_train_like_the_cpu(eager_mode, kind, kw, seed):
    cls = torch.nn.LSTM if kind == "lstm" else torch.nn.GRU
    cpu = cls(5, 6, **kw)
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(4, 3, 5, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    torch_pjrt.reset_metrics()
    got = _train_step(tpu, xt)
    assert not fallbacks(), f"ran on the CPU fallback: {fallbacks()}"
    ops = torch_pjrt.metrics()["ops"]
    fused = f"aten::_thnn_fused_{kind}_cell"
    assert ops.get(fused, (0, 0))[0] > 0, f"{fused} not called natively: {sorted(ops)}"
    want = _train_step(cpu, x)
    assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", [torch.nn.LSTMCell, torch.nn.GRUCell])
@pytest.mark.parametrize("bias", [True, False])
def test_cells_with_a_given_state(eager_mode, cls, bias, seed):
    cpu = cls(4, 7, bias=bias)
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(3, 4, requires_grad=True)
    h = torch.randn(3, 7)
    state = (h, torch.randn(3, 7)) if cls is torch.nn.LSTMCell else h
    xt = x.detach().to("tpu").requires_grad_()
    st = tuple(s.to("tpu") for s in state) if isinstance(state, tuple) else state.to("tpu")
    torch_pjrt.reset_metrics()
    got = _train_step(tpu, xt, st)
    assert not fallbacks()
    assert_close(got, _train_step(cpu, x, state), atol=1e-5, rtol=1e-5)


def test_lstm_backward_with_only_the_cell_state_used(seed):
    # grad_hy is undefined for the backward: only cy feeds the loss.
    cell = torch.nn.LSTMCell(3, 4)
    x = torch.randn(2, 3)

    def run(m, x):
        _, c = m(x)
        c.pow(2).sum().backward()
        return [p.grad for p in m.parameters()]

    tcell = copy.deepcopy(cell).to("tpu")
    torch_pjrt.reset_metrics()
    got = run(tcell, x.to("tpu"))
    assert not fallbacks()
    assert_close(got, run(cell, x), atol=1e-5, rtol=1e-5)


def test_lstm_in_bfloat16(seed):
    m = torch.nn.LSTM(8, 8, num_layers=2)
    x = torch.randn(5, 2, 8)
    want = m.double()(x.double())[0]
    got = copy.deepcopy(m).to("tpu", torch.bfloat16)(x.to("tpu", torch.bfloat16))[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().double(), want, atol=3e-2, rtol=3e-2)


def test_compiled_lstm(seed):
    m = torch.nn.LSTM(4, 5, num_layers=2)
    x = torch.randn(6, 2, 4)
    tm = torch.compile(copy.deepcopy(m).to("tpu"), backend="tpu")
    assert_close(tm(x.to("tpu"))[0], m(x)[0], atol=1e-5, rtol=1e-5)


def test_fused_cell_refuses_mismatched_shapes():
    g = torch.randn(2, 8, device="tpu")
    with pytest.raises(RuntimeError, match="_thnn_fused_lstm_cell"):
        torch.ops.aten._thnn_fused_lstm_cell(g, g, torch.randn(2, 3, device="tpu"))
    with pytest.raises(RuntimeError, match="_thnn_fused_gru_cell"):
        torch.ops.aten._thnn_fused_gru_cell(g[:, :6], g, torch.randn(2, 2, device="tpu"))
