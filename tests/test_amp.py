"""Automatic mixed precision on tpu: torch.autocast("tpu") and torch.amp.GradScaler("tpu").

The op policy is CUDA's. Each op's result is compared with the CPU running the op on the
inputs cast as CUDA's policy casts them (CPU autocast has a different policy), in every eager
mode and inside torch.compile. The GPT of test_training trains 50 steps under bf16 autocast
next to a CPU autocast run; GradScaler's kernels run natively and match the CPU's.
"""

import copy
import math
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import EAGER_MODE_IDS, EAGER_MODES, fallbacks
from test_training import GPT, make_data

import torch_pjrt

EM = torch.tpu.EagerMode
MODES, MODE_IDS = EAGER_MODES, EAGER_MODE_IDS
LOW = (torch.bfloat16, torch.float16)

# CUDA registers these for its own libraries only (cuDNN); they never reach a tpu tensor.
CUDA_ONLY = {"aten::_cudnn_rnn", "aten::cudnn_convolution", "aten::cudnn_convolution_transpose"}


def test_policy_covers_every_op_cuda_autocasts():
    cuda = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    tpu = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastPrivateUse1"))
    assert cuda - CUDA_ONLY == tpu


def test_default_dtype_is_bfloat16_in_every_thread():
    seen = []

    def probe():
        seen.append(torch.get_autocast_dtype("tpu"))
        a = torch.ones(2, 2, device="tpu")
        with torch.autocast("tpu"):
            seen.append((a @ a).dtype)

    probe()
    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert seen == [torch.bfloat16] * 4
    assert torch.tpu.get_amp_supported_dtype() == [torch.bfloat16, torch.float16]
    assert torch.tpu.is_bf16_supported()


def test_explicit_dtype_and_restore():
    a = torch.ones(2, 2, device="tpu")
    with torch.autocast("tpu", dtype=torch.float16):
        assert (a @ a).dtype == torch.float16
        assert torch.get_autocast_dtype("tpu") == torch.float16
        with torch.autocast("tpu", enabled=False):
            assert (a @ a).dtype == torch.float32
    assert torch.get_autocast_dtype("tpu") == torch.bfloat16
    assert (a @ a).dtype == torch.float32


def test_unsupported_dtype_warns_and_disables():
    a = torch.ones(2, 2, device="tpu")
    with pytest.warns(UserWarning, match="not supported"):
        with torch.autocast("tpu", dtype=torch.float64):
            assert (a @ a).dtype == torch.float32


def test_binary_cross_entropy_is_refused_like_cuda():
    p = torch.rand(4, device="tpu")
    with torch.autocast("tpu"), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(p, p)


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed + len(shape))
    return torch.randn(*shape, generator=g)


def _pos(*shape):
    return _x(*shape).abs() + 0.5


# (name, fn, inputs, policy). The policy says how CUDA casts floating inputs: "low" to the
# autocast dtype, "fp32" to float32, "promote" to the widest input dtype (the test gives
# the second input the autocast dtype; PyTorch refuses to promote float16 with bfloat16),
# "same" (no autocast kernel: ops run in their inputs' dtypes).
CASES = [
    ("mm", torch.mm, lambda: (_x(4, 8), _x(8, 3)), "low"),
    ("matmul", torch.matmul, lambda: (_x(2, 4, 8), _x(8, 3)), "low"),
    ("bmm", torch.bmm, lambda: (_x(2, 4, 8), _x(2, 8, 3)), "low"),
    ("baddbmm", torch.baddbmm, lambda: (_x(2, 4, 3), _x(2, 4, 8), _x(2, 8, 3)), "low"),
    ("addmm", torch.addmm, lambda: (_x(3), _x(4, 8), _x(8, 3)), "low"),
    ("linear", F.linear, lambda: (_x(4, 8), _x(3, 8), _x(3)), "low"),
    ("conv2d", lambda x, w: F.conv2d(x, w, padding=1), lambda: (_x(1, 2, 5, 5), _x(3, 2, 3, 3)),
     "low"),
    ("sdpa", F.scaled_dot_product_attention, lambda: (_x(1, 2, 4, 8), _x(1, 2, 4, 8),
                                                      _x(1, 2, 4, 8)), "low"),
    ("softmax", lambda x: torch.softmax(x, -1), lambda: (_x(4, 8),), "fp32"),
    ("log_softmax", lambda x: torch.log_softmax(x, -1), lambda: (_x(4, 8),), "fp32"),
    ("layer_norm", lambda x, w: F.layer_norm(x, (8,), w), lambda: (_x(4, 8), _x(8)), "fp32"),
    ("group_norm", lambda x: F.group_norm(x, 2), lambda: (_x(2, 4, 3),), "fp32"),
    ("exp", torch.exp, lambda: (_x(4, 8),), "fp32"),
    ("log", torch.log, lambda: (_pos(4, 8),), "fp32"),
    ("pow", lambda x: torch.pow(x, 2.5), lambda: (_pos(4, 8),), "fp32"),
    ("sum", torch.sum, lambda: (_x(4, 8),), "fp32"),
    ("cumsum", lambda x: torch.cumsum(x, 1), lambda: (_x(4, 8),), "fp32"),
    ("mse_loss", F.mse_loss, lambda: (_x(4, 8), _x(4, 8, seed=1)), "fp32"),
    ("cross_entropy", F.cross_entropy, lambda: (_x(4, 8), torch.tensor([1, 0, 7, 3])), "fp32"),
    ("addcmul", torch.addcmul, lambda: (_x(4), _x(4, seed=1), _x(4, seed=2)), "promote"),
    ("atan2", torch.atan2, lambda: (_x(4), _x(4, seed=1)), "promote"),
    ("add", torch.add, lambda: (_x(4).bfloat16(), _x(4)), "same"),
    ("relu", torch.relu, lambda: (_x(4, 8),), "same"),
]


def _cast_like_cuda(args, policy, low):
    floats = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if policy == "low":
        to = low
    elif policy == "fp32":
        to = torch.float32
    elif policy == "promote":
        to = max(floats, key=lambda d: torch.finfo(d).bits)
    else:
        return args
    return [a.to(to) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]


def _check_case(fn, make, policy, low, run):
    args = list(make())
    if policy == "promote":
        args[1] = args[1].to(low)
    want = fn(*_cast_like_cuda(args, policy, low))
    got = run(fn, [a.to("tpu") for a in args], low)
    assert got.dtype == want.dtype
    tol = 2e-2 if want.dtype in LOW else 1e-5
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)


def _eager(fn, args, low):
    with torch.autocast("tpu", dtype=low):
        return fn(*args)


@pytest.mark.parametrize("low", LOW, ids=["bf16", "f16"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name,fn,make,policy", CASES, ids=[c[0] for c in CASES])
def test_op_policy(name, fn, make, policy, mode, low, no_fallback):
    with torch.tpu.set_eager_mode(mode):
        _check_case(fn, make, policy, low, _eager)


@pytest.mark.parametrize("name,fn,make,policy", CASES, ids=[c[0] for c in CASES])
def test_op_policy_compiled(name, fn, make, policy):
    def run(fn, args, low):
        def body(*xs):
            with torch.autocast("tpu", dtype=low):
                return fn(*xs)

        return torch.compile(body, backend="tpu", fullgraph=True)(*args)

    torch._dynamo.reset()
    _check_case(fn, make, policy, torch.bfloat16, run)
    assert torch_pjrt.metrics()["compile"]["dynamo_graph_breaks"] == 0


def test_backward_keeps_float32_master_gradients():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4).to("tpu")
    x = torch.randn(3, 8, device="tpu")
    with torch.autocast("tpu"):
        y = lin(x)
        assert y.dtype == torch.bfloat16
        loss = y.float().pow(2).sum()
    loss.backward()
    assert lin.weight.grad.dtype == torch.float32
    ref = copy.deepcopy(lin).cpu()
    out = F.linear(x.cpu().bfloat16(), ref.weight.bfloat16(), ref.bias.bfloat16())
    out.float().pow(2).sum().backward()
    torch.testing.assert_close(lin.weight.grad.cpu(), ref.weight.grad, atol=5e-2, rtol=2e-2)


STEPS = 50


def _train_gpt(device, dtypes=None):
    torch.manual_seed(0)
    model = GPT().to(device)
    if dtypes is not None:
        # The loss alone cannot tell: float32 training is as close to CPU autocast's.
        model.head.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
        model.ln_f.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    data = (make_data("gpt") * 3)[:STEPS]
    losses = []
    for x, y in data:
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_gpt_trains_under_bf16_autocast_like_cpu(mode):
    cpu = _train_gpt("cpu")
    torch_pjrt.reset_metrics()
    dtypes = set()
    with torch.tpu.set_eager_mode(mode):
        tpu = _train_gpt("tpu", dtypes)
    assert dtypes == {torch.bfloat16, torch.float32}  # the head in bf16, its layer norm in f32
    assert not fallbacks()
    assert cpu[-1] < cpu[0] * 0.8  # it trains
    for step, (a, b) in enumerate(zip(tpu, cpu, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-2), f"step {step}: tpu {a} vs cpu {b}"


class TwoLayer(nn.Module):
    """Linear layers and an MSE loss: CPU autocast and CUDA's policy agree on every op."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x, y):
        return F.mse_loss(self.b(torch.relu(self.a(x))).float(), y)


def _train_scaled(device, steps, poison_step=None, compiled=False):
    torch.manual_seed(0)
    model = TwoLayer().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**14, growth_interval=3)
    g = torch.Generator().manual_seed(5)
    scales, losses = [], []
    step_fn = model
    if compiled:
        step_fn = torch.compile(model, backend="tpu")
    for i in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        if i == poison_step:
            x[0, 0] = float("inf")
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = step_fn(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        losses.append(loss.item())
    return scales, losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_grad_scaler_float16_matches_cpu(mode, compiled):
    cpu = _train_scaled("cpu", 8, poison_step=4)
    torch_pjrt.reset_metrics()
    with torch.tpu.set_eager_mode(mode):
        tpu = _train_scaled("tpu", 8, poison_step=4, compiled=compiled)
    assert tpu[0] == cpu[0]  # same scale history: growth every 3 steps, back off at the inf
    assert cpu[0][4] == cpu[0][3] / 2
    assert math.isnan(tpu[1][4]) == math.isnan(cpu[1][4])
    torch.testing.assert_close(tpu[1][:4], cpu[1][:4], atol=0, rtol=2e-3)
    for k in cpu[2]:
        torch.testing.assert_close(tpu[2][k], cpu[2][k], atol=2e-3, rtol=2e-3)
    ops = torch_pjrt.metrics()["ops"]
    if not compiled:
        for op in ("aten::_amp_foreach_non_finite_check_and_unscale_", "aten::_amp_update_scale_"):
            assert ops.get(op, (0, 0))[0] > 0 and ops[op][1] == 0, ops.get(op)
    assert not fallbacks()


def _scaler_inputs():
    grads = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([[0.5, 4.0]]).half(),
             torch.tensor([2.0, 8.0]).bfloat16()]
    return grads, torch.zeros(1), torch.full((1,), 0.25)


@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_unscale_kernel_matches_cpu(bad):
    def run(device):
        grads, found, inv = _scaler_inputs()
        if bad is not None:
            grads[1][0, 1] = bad
        grads = [g.to(device) for g in grads]
        found, inv = found.to(device), inv.to(device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        return [g.cpu() for g in grads], found.cpu()

    (cg, cf), (tg, tf) = run("cpu"), run("tpu")
    torch.testing.assert_close(tf, cf)
    for a, b in zip(tg, cg, strict=True):
        torch.testing.assert_close(a, b, equal_nan=True)


@pytest.mark.parametrize("found,tracker,interval", [(0.0, 0, 3), (0.0, 2, 3), (1.0, 2, 3),
                                                     (0.0, 0, 1)])
def test_update_scale_kernel_matches_cpu(found, tracker, interval):
    def run(device, scale=1024.0):
        s = torch.tensor([scale], device=device)
        t = torch.tensor([tracker], dtype=torch.int32, device=device)
        f = torch.tensor([found], device=device)
        torch._amp_update_scale_(s, t, f, 2.0, 0.5, interval)
        return s.cpu(), t.cpu()

    assert run("tpu") == run("cpu")
    # A grown scale that overflows float32 keeps the old one.
    big = torch.finfo(torch.float32).max / 1.5
    assert run("tpu", big) == run("cpu", big)


@pytest.mark.parametrize(
    "call",
    [
        lambda d: torch._amp_foreach_non_finite_check_and_unscale_(
            [torch.ones(2, device=d)], torch.zeros(2, device=d), torch.ones(1, device=d)),
        lambda d: torch._amp_foreach_non_finite_check_and_unscale_(
            [torch.ones(2, device=d)], torch.zeros(1, device=d),
            torch.ones(1, dtype=torch.float64, device=d)),
        lambda d: torch._amp_update_scale_(
            torch.ones(1, device=d), torch.zeros(1, device=d), torch.zeros(1, device=d),
            2.0, 0.5, 2),
        lambda d: torch._amp_update_scale_(
            torch.ones(2, device=d), torch.zeros(1, dtype=torch.int32, device=d),
            torch.zeros(1, device=d), 2.0, 0.5, 2),
        lambda d: torch._amp_foreach_non_finite_check_and_unscale_(
            [torch.ones(2, dtype=torch.long, device=d)], torch.zeros(1, device=d),
            torch.ones(1, device=d)),
    ],
    ids=["found-numel", "inv-dtype", "tracker-dtype", "scale-numel", "int-grads"],
)
def test_scaler_kernel_errors_match_cpu(call):
    with pytest.raises(RuntimeError) as cpu:
        call("cpu")
    with pytest.raises(RuntimeError) as tpu:
        call("tpu")
        torch.tpu.synchronize()
    assert type(tpu.value) is type(cpu.value)
    assert str(tpu.value).splitlines()[0] == str(cpu.value).splitlines()[0]
