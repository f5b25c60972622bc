"""``torch.compile(backend="tpu")`` and ``torch_pjrt.export_stablehlo`` against PyTorch CPU eager.

Models (small, so the file runs in well under 3 minutes on 2 cores): an MLP 784-128-128-10,
bench/models.py's GPT (examples/train_gpt.py's model, 2 layers, d_model 32) and a ResNet-style
CNN (conv-bn-relu stem, 2 residual blocks, adaptive average pool, linear), the CNN in train and
eval mode. The compiled model runs on tpu, the same model uncompiled on the CPU is the oracle:
forward, gradients, and 10 optimizer steps (SGD with momentum, AdamW) whose losses must agree
within 1e-4 relative at every step. Most tests run in both eager modes the surrounding code
may use (Strict, the default, and DeferAndFuse): the compiled graphs are captured the same way
in either, but the eager code around them (optimizer, loss, AOTAutograd's glue) differs.
"""

import copy
import math
import os
import sys

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from conftest import Float64Twin, assert_close, assert_trained_close, fallbacks, to_cpu

import torch_pjrt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import models  # noqa: E402  (bench/models.py: the GPT of examples/train_gpt.py)

STEPS = 10
WARMUP = 3
RTOL = 1e-4

MODES = {
    "strict": torch.tpu.EagerMode.DEFER_NEVER,
    "defer": torch.tpu.EagerMode.DEFER_AND_FUSE,
}


@pytest.fixture(params=list(MODES))
def mode(request):
    """The eager mode around the compiled calls."""
    with torch.tpu.set_eager_mode(MODES[request.param]):
        yield request.param


@pytest.fixture(autouse=True)
def _fresh():
    """Each test compiles from scratch and counts from zero."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # metrics()["compile"]["dynamo_graph_breaks"]
    torch_pjrt.reset_metrics()
    yield
    torch._dynamo.reset()


def compile_counters():
    return torch_pjrt.metrics()["compile"]


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
        )

    def forward(self, x):
        return self.net(x)


CNN = models.CNN


VOCAB, SEQ = 32, 16


def gpt():
    return models.GPT(VOCAB, d_model=32, n_heads=2, n_layers=2, seq_len=SEQ)


def make(name, seed=0):
    """(model, inputs, targets, loss_fn) on the CPU, deterministic."""
    g = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)
    if name == "mlp":
        model = MLP()
        x = torch.randn(16, 784, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
    elif name.startswith("cnn"):
        model = CNN(8)
        if name == "cnn_eval":
            # Non-trivial running statistics for eval mode.
            with torch.no_grad():
                for m in model.modules():
                    if isinstance(m, nn.BatchNorm2d):
                        m.running_mean.uniform_(-0.5, 0.5, generator=g)
                        m.running_var.uniform_(0.5, 1.5, generator=g)
            model.eval()
        x = torch.randn(4, 3, 12, 12, generator=g)
        y = torch.randint(0, 10, (4,), generator=g)
    elif name == "gpt":
        model = gpt()
        x = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    else:
        raise ValueError(name)

    def loss_fn(out, target):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    return model, x, y, loss_fn


def pair(name, seed=0, **compile_kw):
    """CPU model and its compiled tpu copy (same weights), inputs on both devices."""
    model, x, y, loss_fn = make(name, seed)
    tpu_model = copy.deepcopy(model).to("tpu")
    compiled = torch.compile(tpu_model, backend="tpu", **compile_kw)
    return model, tpu_model, compiled, (x, y), (x.to("tpu"), y.to("tpu")), loss_fn


def assert_state_close(tpu_model, cpu_model, grads=True, atol=1e-5, rtol=1e-4):
    """Parameters, buffers (BatchNorm running stats) and, with grads, gradients agree."""
    params = zip(tpu_model.named_parameters(), cpu_model.named_parameters(), strict=True)
    for (n, p), (_, q) in params:
        assert_close(p, q.detach(), atol=atol, rtol=rtol, msg=f"parameter {n} differs")
        if grads:
            assert (p.grad is None) == (q.grad is None), n
            if q.grad is not None:
                assert_close(p.grad, q.grad, atol=atol, rtol=rtol, msg=f"{n}.grad differs")
    for (n, b), (_, c) in zip(tpu_model.named_buffers(), cpu_model.named_buffers(), strict=True):
        assert_close(b, c, atol=atol, rtol=rtol, msg=f"buffer {n} differs")


def assert_captured():
    """Every graph was captured whole (none fell back to running op by op)."""
    c = compile_counters()
    assert c.get("compiled_graphs", 0) > 0, c
    assert not c.get("graph_breaks", 0), f"a graph could not be captured: {c}; fallbacks {fallbacks()}"
    assert not c.get("eager_graphs", 0), c


# The models in both eager modes; the GPT in the default one only (it is the slowest).
MODEL_MODES = [
    ("mlp", "strict"), ("mlp", "defer"),
    ("cnn_train", "strict"), ("cnn_train", "defer"),
    ("cnn_eval", "strict"), ("cnn_eval", "defer"),
    ("gpt", "strict"),
]


@pytest.fixture
def model_mode(request):
    name, m = request.param
    with torch.tpu.set_eager_mode(MODES[m]):
        yield name


# ---------------------------------------------------------------------------
# Forward and backward
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("model_mode", MODEL_MODES, indirect=True, ids=lambda p: "-".join(p))
def test_forward_backward(model_mode):
    cpu_model, tpu_model, compiled, (x, y), (xt, yt), loss_fn = pair(model_mode)
    out = cpu_model(x)
    loss = loss_fn(out, y)
    loss.backward()
    out_t = compiled(xt)
    loss_t = loss_fn(out_t, yt)
    loss_t.backward()
    assert out_t.device.type == "tpu"
    assert_close(out_t, out.detach(), atol=1e-5, rtol=1e-4)
    assert_close(loss_t, loss.detach(), atol=0, rtol=RTOL)
    assert_state_close(tpu_model, cpu_model)
    assert_captured()
    assert not fallbacks(), fallbacks()


# ---------------------------------------------------------------------------
# Training: compiled model, eager optimizer
# ---------------------------------------------------------------------------


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=ADAMW_LR, weight_decay=0.01)


ADAMW_LR = 1e-3
# The most STEPS optimizer steps can move an ill-conditioned element (Float64Twin): AdamW's
# step is lr * m / sqrt(v), within 2 lr over a few steps; SGD's steps are not amplified.
MAX_MOVE = {"adamw": 2 * ADAMW_LR * STEPS, "sgd": 0.0}


TRAIN_CASES = [
    ("mlp", "strict", "sgd"), ("mlp", "strict", "adamw"),
    ("mlp", "defer", "sgd"), ("mlp", "defer", "adamw"),
    ("cnn_train", "strict", "sgd"), ("cnn_train", "strict", "adamw"),
    ("cnn_train", "defer", "sgd"), ("cnn_train", "defer", "adamw"),
    ("gpt", "strict", "adamw"), ("gpt", "defer", "sgd"),
]


@pytest.mark.parametrize("name,m,opt_name", TRAIN_CASES, ids=["-".join(c) for c in TRAIN_CASES])
def test_training_steps(name, m, opt_name):
    make_opt = {"sgd": sgd, "adamw": adamw}[opt_name]
    cpu_model, tpu_model, compiled, (x, y), (xt, yt), loss_fn = pair(name)
    opt, opt_t = make_opt(cpu_model.parameters()), make_opt(tpu_model.parameters())
    twin = Float64Twin(cpu_model, make_opt)
    x64, y64 = twin.inputs(x, y)
    compilations = []
    with torch.tpu.set_eager_mode(MODES[m]):
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(cpu_model(x), y)
            loss.backward()
            twin.opt.zero_grad(set_to_none=True)
            loss_fn(twin.model(x64), y64).backward()
            twin.note_grads(cpu_model)
            opt.step()
            twin.opt.step()
            opt_t.zero_grad(set_to_none=True)
            loss_t = loss_fn(compiled(xt), yt)
            loss_t.backward()
            opt_t.step()
            a, b = loss.item(), loss_t.item()
            assert math.isclose(b, a, rel_tol=RTOL), f"step {step}: tpu loss {b}, CPU loss {a}"
            compilations.append(torch_pjrt.metrics()["compilations"])
    assert_trained_close(tpu_model, cpu_model, twin, MAX_MOVE[opt_name], atol=1e-4, rtol=1e-3)
    for (n, b), (_, c) in zip(tpu_model.named_buffers(), cpu_model.named_buffers(), strict=True):
        assert_close(b, c, atol=1e-4, rtol=1e-3, msg=f"buffer {n} differs")
    assert_captured()
    c = compile_counters()
    # Forward and backward graphs, each captured once; later steps replay them.
    assert c["compiled_graphs"] <= 2, c
    assert not c.get("recompilations", 0), c
    after_warmup = compilations[WARMUP - 1:]
    assert after_warmup == [after_warmup[0]] * len(after_warmup), (
        f"XLA compilations per step after warm-up: {compilations}"
    )
    assert not fallbacks(), fallbacks()


def test_default_backend_says_to_pass_backend_tpu():
    """torch.compile without backend= is Inductor, which cannot generate tpu code: one clear
    error naming the fix, not Inductor's Pallas generator failing to import jax; Inductor
    on CPU tensors is untouched."""
    f = torch.compile(lambda x: (x * 2 + 1).sin())
    with pytest.raises(RuntimeError, match='backend="tpu"'):
        f(torch.ones(3, device="tpu"))
    torch._dynamo.reset()
    g = torch.compile(lambda x: (x * 2 + 1).sin())
    assert_close(g(torch.ones(3)), torch.full((3,), 3.0).sin())


def test_trained_close_has_teeth():
    """assert_trained_close passes a faithful copy and fails one wrong element: one where the
    update is well conditioned (compared with the CPU), one where it is not (compared with
    the float64 run, within the optimizer's largest move)."""
    cpu_model, x, y, loss_fn = make("gpt")
    twin = Float64Twin(cpu_model, adamw)
    opt = adamw(cpu_model.parameters())
    x64, y64 = twin.inputs(x, y)
    for _ in range(3):
        for model, o, a, b in ((cpu_model, opt, x, y), (twin.model, twin.opt, x64, y64)):
            o.zero_grad(set_to_none=True)
            loss_fn(model(a), b).backward()
        twin.note_grads(cpu_model)
        opt.step()
        twin.opt.step()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    max_move = 2 * ADAMW_LR * 3
    assert assert_trained_close(tpu_model, cpu_model, twin, max_move, atol=1e-4, rtol=1e-3)
    noisy = twin.noisy["blocks.0.qkv.bias"]
    well = (~noisy).nonzero()[0].item()
    bad = noisy.nonzero()[0].item()
    for i, delta in ((well, 1e-3), (bad, 2 * max_move)):
        wrong = copy.deepcopy(tpu_model)
        with torch.no_grad():
            wrong.blocks[0].qkv.bias[i] += delta
        with pytest.raises(AssertionError, match="blocks.0.qkv.bias"):
            assert_trained_close(wrong, cpu_model, twin, max_move, atol=1e-4, rtol=1e-3)


def test_replay_compiles_nothing(mode):
    """The second and later calls replay: no capture, no XLA compilation, same results.

    In DeferAndFuse a replay is one call in the pending graph, whose program is compiled
    once for its structure: on the first replay, then never again."""
    cpu_model, tpu_model, compiled, (x, y), (xt, yt), loss_fn = pair("mlp")
    with torch.no_grad():
        compiled(xt)
    m0 = torch_pjrt.metrics()
    assert m0["compile"]["compiled_graphs"] == 1
    for seed in range(4):
        x2 = torch.randn(16, 784, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            out = compiled(x2.to("tpu"))
        assert_close(out, cpu_model(x2).detach(), atol=1e-5, rtol=1e-4)
        if seed == 0 and mode == "defer":
            m0 = torch_pjrt.metrics()
    m1 = torch_pjrt.metrics()
    assert m1["compile"]["compiled_graphs"] == 1, m1["compile"]
    assert m1["compilations"] == m0["compilations"], (m0["compilations"], m1["compilations"])


def test_replayed_index_check_raises(mode):
    """An out-of-range index in a replayed graph raises IndexError at the next read or
    synchronization in every mode (in DeferAndFuse the replay's check joins the pending
    graph's), and later calls with good indices work."""
    emb = torch.nn.Embedding(10, 4)
    emb_t = copy.deepcopy(emb).to("tpu")
    f = torch.compile(lambda i: emb_t(i).sum(), backend="tpu")
    good = torch.tensor([1, 2, 3])
    with torch.no_grad():
        for _ in range(2):  # capture, then replay
            assert math.isclose(f(good.to("tpu")).item(), emb(good).sum().item(), rel_tol=1e-5)
        with pytest.raises(IndexError, match="index out of range"):
            f(torch.tensor([1, 12, 3]).to("tpu")).item()
            torch.tpu.synchronize()
        assert math.isclose(f(good.to("tpu")).item(), emb(good).sum().item(), rel_tol=1e-5)
    assert compile_counters()["compiled_graphs"] == 1


def test_boxed_calling_convention():
    """Forward and backward graphs take AOTAutograd's boxed (list) arguments: no warning."""
    import warnings

    w = torch.randn(4, 3).to("tpu").requires_grad_()
    cf = torch.compile(lambda x: (x @ w).tanh().sum(), backend="tpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cf(torch.randn(2, 4).to("tpu")).backward()
    assert not [m for m in caught if "boxed" in str(m.message)], [str(m.message) for m in caught]
    assert compile_counters()["compiled_graphs"] == 2


# ---------------------------------------------------------------------------
# A whole training step inside the compiled function
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("how", ["step_fn", "opt_step"])
def test_compiled_train_step(opt_name, how, mode):
    """The optimizer update compiled, as one program: either forward + backward +
    ``opt.step()`` in one compiled function (Dynamo breaks the graph at ``loss.backward()``;
    forward, AOTAutograd's backward and the update are compiled separately), or a compiled
    loss next to ``torch.compile(opt.step)``. The update writes parameters and optimizer
    state in place inside the program (no eager copy per tensor, their buffers donated to
    the new values), AdamW's step counters
    live on the tpu device as Dynamo keeps them on CUDA, and results match the CPU."""
    make_opt = {"sgd": sgd, "adamw": adamw}[opt_name]
    cpu_model, x, y, loss_fn = make("mlp")
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    xt, yt = x.to("tpu"), y.to("tpu")

    def make_step(model, compiled):
        opt = make_opt(model.parameters())
        if compiled and how == "opt_step":
            loss_c = torch.compile(lambda x, y: loss_fn(model(x), y), backend="tpu")
            opt_step = torch.compile(opt.step, backend="tpu")

            def step(x, y):
                opt.zero_grad(set_to_none=True)
                loss = loss_c(x, y)
                loss.backward()
                opt_step()
                return loss

            return opt, step

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            return loss

        return opt, (torch.compile(step, backend="tpu") if compiled else step)

    (_, step), (opt_t, step_t) = make_step(cpu_model, False), make_step(tpu_model, True)
    twin = Float64Twin(cpu_model)
    _, step64 = make_step(twin.model, False)
    x64, y64 = twin.inputs(x, y)
    executions, donated = [], []
    for i in range(STEPS):
        m0 = torch_pjrt.metrics()
        a, b = step(x, y).item(), step_t(xt, yt).item()
        step64(x64, y64)
        twin.note_grads(cpu_model)  # the steps leave their gradients in .grad
        torch.tpu.synchronize()  # Strict replays are queued: .item() waits for the loss only
        m1 = torch_pjrt.metrics()
        executions.append(m1["executions"] - m0["executions"])
        donated.append(m1["donated_buffers"] - m0["donated_buffers"])
        assert math.isclose(b, a, rel_tol=RTOL), f"step {i}: tpu loss {b}, CPU loss {a}"
    assert_trained_close(tpu_model, cpu_model, twin, MAX_MOVE[opt_name], atol=1e-4, rtol=1e-3)
    assert_captured()
    c = compile_counters()
    # Forward, backward and the update (its first call, before the state exists, may be
    # traced apart from the later ones).
    assert 3 <= c["compiled_graphs"] <= 4, c
    if opt_name == "adamw":
        steps = [s["step"] for s in opt_t.state.values()]
        assert steps and all(t.device.type == "tpu" for t in steps), [t.device for t in steps]
    # A warm step runs a handful of programs (forward, backward, update, zero_grad's and the
    # loss read's small ops), not one per parameter; in DeferAndFuse the replays are calls in
    # the pending graph, so the whole step is one program.
    assert max(executions[WARMUP:]) <= (1 if mode == "defer" else 8), executions
    # The update writes each parameter into its own buffer (no second copy of the weights).
    n_params = len(list(tpu_model.parameters()))
    assert min(donated[WARMUP:]) >= n_params, donated
    assert not fallbacks(), fallbacks()


# ---------------------------------------------------------------------------
# Graph breaks, ops without a lowering
# ---------------------------------------------------------------------------


class Broken(nn.Module):
    """A graph break in the middle of forward (Dynamo splits it into two graphs)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.how == "graph_break":
            torch._dynamo.graph_break()
        else:
            print("graph break:", tuple(h.shape))
        return self.b(h * 2)


@pytest.mark.parametrize("how", ["graph_break", "print"])
def test_graph_break(how, mode, capsys):
    torch.manual_seed(0)
    cpu_model = Broken(how)
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    compiled = torch.compile(tpu_model, backend="tpu")
    x = torch.randn(8, 16)
    for _ in range(2):
        out = cpu_model(x)
        out.square().sum().backward()
        out_t = compiled(x.to("tpu"))
        out_t.square().sum().backward()
        assert_close(out_t, out.detach(), atol=1e-5, rtol=1e-4)
    assert_state_close(tpu_model, cpu_model)
    c = compile_counters()
    assert c["dynamo_graph_breaks"] > 0, c
    # Both pieces, forward and backward each.
    assert c["compiled_graphs"] >= 4, c
    assert not c.get("graph_breaks", 0), c
    if how == "print":
        assert "graph break: (8, 32)" in capsys.readouterr().out


# Ops that are (today) not lowered and that AOTAutograd does not decompose; the test
# takes the first one still without a lowering rule.
UNLOWERED = [
    ("aten::special_bessel_j0", torch.special.bessel_j0),
    ("aten::special_airy_ai", torch.special.airy_ai),
    ("aten::special_scaled_modified_bessel_k0", torch.special.scaled_modified_bessel_k0),
    ("aten::_linalg_eigh", lambda h: torch.linalg.eigvalsh(h @ h.T)),
    ("aten::_standard_gamma_grad", lambda h: torch._standard_gamma_grad(h.abs() + 1, h.abs() + 1)),
]


def unlowered_op():
    lowered = set(torch_pjrt.lowered_ops())
    for name, fn in UNLOWERED:
        if name not in lowered:
            return name, fn
    pytest.skip("every candidate op has a lowering now; add another to UNLOWERED")


def test_unlowered_op_in_graph(mode):
    """An op without a lowering inside a graph falls back to the CPU; the graph cannot be
    captured as one program, so it runs op by op (counted), and results stay right."""
    name, op = unlowered_op()

    def f(x, w):
        h = torch.relu(x @ w)
        return op(h).sum() + h.mean(dim=1)

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g)
    cf = torch.compile(f, backend="tpu")
    for _ in range(3):
        assert_close(cf(x.to("tpu"), w.to("tpu")), f(x, w), atol=1e-5, rtol=1e-4)
    c = compile_counters()
    assert c.get("graph_breaks", 0) >= 1, c
    assert c.get("eager_graph_calls", 0) >= 2, c
    fb = fallbacks()
    assert fb.get(name, 0) >= 3, fb


@torch.library.custom_op("torch_pjrt_test::zero_from", mutates_args=())
def _zero_from(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """x with its elements from index n[0] on zeroed: the kernel reads n on the host."""
    out = x.clone()
    out[int(n[0]):] = 0
    return out


@_zero_from.register_fake
def _(x, n):
    return torch.empty_like(x)


def test_op_reading_an_input_on_the_host_is_not_replayed(mode):
    """A kernel that reads a graph input's values on the host steers the capture by that
    data (as the composite grouped matmul did with its offsets): a replay would reuse the
    first call's choice. Such a graph runs op by op; each call gives the CPU's result."""
    x = torch.arange(1.0, 9.0)

    def f(x, n):
        return _zero_from(x * 2, n) + 1

    cf = torch.compile(f, backend="tpu")
    for n in (3, 6, 1):
        n = torch.tensor([n])
        assert_close(cf(x.to("tpu"), n.to("tpu")), f(x, n))
    assert compile_counters().get("compiled_graphs", 0) == 0, compile_counters()


def test_view_planned_on_cpu_strides(mode):
    """AOTAutograd places views where the CPU's (meta kernels') strides allow them: a
    LAPACK-style result is column-major there, so the view of its transpose must run
    (Qwen3-Next's linear attention trained compiled failed at such a view)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 4, 3, generator=g)

    def f(a):
        return torch.geqrf(a * 2)[0].mT.reshape(2, 12).sin()

    cf = torch.compile(f, backend="tpu")
    for _ in range(2):
        assert_close(cf(a.to("tpu")), f(a), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True])
def test_output_that_is_a_view_of_an_input_is_that_view(dynamic):
    """A graph returning a view of its input (AOTAutograd regenerates it from the input with
    the returned tensor's strides): under dynamic shapes a dense result gave the permuted
    view's values in the input's order (timm's Sequencer2d, compiled, 5% off)."""
    torch._dynamo.reset()
    f = torch.compile(lambda x: x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3]),
                      backend="tpu", dynamic=dynamic)
    for n in (4, 4, 6, 5):
        x = torch.randn(1, n, n, 8)
        xt = x.to("tpu")
        got = f(xt)
        assert_close(got, x.permute(0, 2, 1, 3).reshape(-1, n, 8), atol=0, rtol=0)
        assert got.untyped_storage().data_ptr() == xt.untyped_storage().data_ptr()
        assert got.stride() == x.permute(0, 2, 1, 3).reshape(-1, n, 8).stride()


def test_graph_views_become_reshapes_unless_written_through():
    """The capture's graphs replace aten.view by aten.reshape (same values, a copy where a
    tpu kernel's layout differs from the meta kernel's), but not a view an op writes to."""
    from torch_pjrt.compile import _views_as_reshapes

    def f(x, y):
        v = torch.ops.aten.view.default(x.transpose(0, 1), [12])
        w = torch.ops.aten.view.default(y, [12])
        torch.ops.aten.add_.Tensor(w, 1.0)
        return v * 2

    gm = torch.fx.symbolic_trace(f)
    gm = _views_as_reshapes(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.reshape.default) == 1, targets
    assert targets.count(torch.ops.aten.view.default) == 1, targets
    x, y = torch.arange(12.0).reshape(3, 4), torch.zeros(3, 4)
    assert_close(gm(x, y), x.t().reshape(12) * 2)
    assert bool((y == 1).all())


def test_grouped_matmul_graph_is_one_program(mode):
    """Mixture-of-experts layers' grouped matmul (rows grouped by data-dependent offsets):
    forward and backward graphs compile once and replay with other offsets, giving the
    CPU's results and gradients."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(10, 8, generator=g), torch.randn(3, 8, 4, generator=g)

    def f(a, b, offs):
        return torch._grouped_mm(a, b, offs=offs).square().sum()

    cf = torch.compile(f, backend="tpu")
    for offs in ([2, 7, 10], [6, 6, 10], [1, 3, 10]):
        offs = torch.tensor(offs, dtype=torch.int32)
        ac, bc = a.clone().requires_grad_(), b.clone().requires_grad_()
        at, bt = a.to("tpu").requires_grad_(), b.to("tpu").requires_grad_()
        want = f(ac, bc, offs)
        want.backward()
        got = cf(at, bt, offs.to("tpu"))
        got.backward()
        assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert_close(at.grad, ac.grad, atol=1e-5, rtol=1e-5)
        assert_close(bt.grad, bc.grad, atol=1e-5, rtol=1e-5)
    c = compile_counters()
    assert c.get("graph_breaks", 0) == 0 and c["compiled_graphs"] == 2, c


def test_static_cache_decode_compiles_once(mode):
    """bench/generate.py's compiled configuration: greedy decoding with a static key/value
    cache written in place at a position tensor gives the CPU's tokens from two graphs
    (prefill and step), not one per token, and later generations compile nothing."""
    torch.manual_seed(0)
    cpu = models.Llama(dim=32, heads=4, kv_heads=2, hidden=64).eval()
    ids = torch.randint(0, 256, (2, 5))
    want = cpu.generate(ids, 6)
    m = copy.deepcopy(cpu).to("tpu")
    step = torch.compile(m.forward_static, backend="tpu")
    assert torch.equal(m.generate_static(ids.to("tpu"), 6, step=step).cpu(), want)
    c = compile_counters()
    assert c["compiled_graphs"] == 2 and c.get("dynamo_graph_breaks", 0) == 0, c
    # In DeferAndFuse the second call compiles its pending graphs once more: the first call
    # captured the two graphs (run op by op), the second records their replays into the
    # pending graph. From then on nothing compiles.
    for _ in range(2):
        before = torch_pjrt.metrics()["compilations"]
        assert torch.equal(m.generate_static(ids.to("tpu"), 6, step=step).cpu(), want)
    assert torch_pjrt.metrics()["compilations"] == before
    assert compile_counters()["compiled_graphs"] == 2


# ---------------------------------------------------------------------------
# Dynamic shapes
# ---------------------------------------------------------------------------


def live_programs():
    return compile_counters()["live_programs"]


LENGTHS = [5, 9, 17, 33, 12, 7, 9, 33, 5]


@pytest.mark.parametrize("how", ["dynamic", "mark_dynamic"])
@pytest.mark.usefixtures("exact_shapes")
def test_dynamic_sequence_length(how, record_property):
    """One Dynamo graph for every sequence length (dynamic=True / mark_dynamic). With shape
    buckets off (tests/test_dynamic.py has them on), the backend captures and compiles each
    distinct length once, forward and backward, and replays
    repeated lengths; results are those of CPU eager for every length."""
    torch.manual_seed(0)
    cpu_model = models.GPT(VOCAB, d_model=32, n_heads=2, n_layers=2, seq_len=64)
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    compiled = torch.compile(tpu_model, backend="tpu", dynamic=True if how == "dynamic" else None)
    live0 = live_programs()
    g = torch.Generator().manual_seed(1)
    for t in LENGTHS:
        x = torch.randint(0, VOCAB, (2, t), generator=g)
        y = torch.randint(0, VOCAB, (2, t), generator=g)
        xt = x.to("tpu")
        if how == "mark_dynamic":
            torch._dynamo.mark_dynamic(xt, 1)
        cpu_model.zero_grad(set_to_none=True)
        tpu_model.zero_grad(set_to_none=True)
        logits = cpu_model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        logits_t = compiled(xt)
        loss_t = F.cross_entropy(logits_t.reshape(-1, VOCAB), y.to("tpu").reshape(-1))
        loss_t.backward()
        assert logits_t.shape == (2, t, VOCAB)
        assert_close(logits_t, logits.detach(), atol=1e-5, rtol=1e-4)
        assert math.isclose(loss_t.item(), loss.item(), rel_tol=RTOL), t
        assert_state_close(tpu_model, cpu_model)
    c = compile_counters()
    distinct = len(set(LENGTHS))
    record_property("compiled_programs", c["compiled_graphs"])
    record_property("distinct_lengths", distinct)
    assert c["dynamo_graph_breaks"] == 0, c
    assert c["dynamo_graphs"] == 1, c  # one symbolic graph for every length
    # Forward and backward once per distinct length; the repeated lengths replay.
    assert c["compiled_graphs"] == 2 * distinct, c
    assert c["recompilations"] == c["recompilations_new_shape"] == 2 * (distinct - 1), c
    assert live_programs() - live0 == 2 * distinct, c
    assert not c.get("graph_breaks", 0), c


@pytest.mark.usefixtures("exact_shapes")
def test_max_programs_evicts_least_recently_used(mode):
    """options={"max_programs": 2}: a third length frees the least recently used program;
    a freed length is captured again (counted by reason) and still right."""
    def f(x, w):
        return (x * w).sum(-1).tanh()

    cf = torch.compile(f, backend="tpu", dynamic=True, options={"max_programs": 2})
    live0 = live_programs()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, generator=g)
    for n in (3, 4, 5, 3, 5, 6):
        x = torch.randn(n, 8, generator=g)
        assert_close(cf(x.to("tpu"), w.to("tpu")), f(x, w), atol=1e-6, rtol=1e-5)
        assert live_programs() - live0 <= 2
    c = compile_counters()
    assert c["dynamo_graphs"] == 1, c
    # 3, 4, 5 (evicts 3), 3 again (evicts 4), 5 replays, 6 (evicts 5).
    assert c["compiled_graphs"] == 5, c
    assert c["evicted_programs"] == 3, c
    assert c["recompilations_new_shape"] == 3 and c["recompilations_evicted"] == 1, c
    assert live_programs() - live0 == 2, c


def test_replay_layouts_and_lru(mode):
    """Programs are kept per input layout, not only per shape: the same shape at another
    offset of a larger storage is captured once, counted as a new layout, and replays count
    as uses for max_programs' least-recently-used order."""
    def f(x, w):
        return (x * w).sum(-1).tanh()

    cf = torch.compile(f, backend="tpu", options={"max_programs": 2})
    g = torch.Generator().manual_seed(0)
    base, w = torch.randn(40, 8, generator=g), torch.randn(8, generator=g)
    bt, wt = base.to("tpu"), w.to("tpu")
    live0 = live_programs()
    rows = {"a": 0, "b": 5, "c": 10}
    for name in "abaca":
        r = rows[name]
        assert_close(cf(bt[r:r + 5], wt), f(base[r:r + 5], w), atol=1e-6, rtol=1e-5)
    c = compile_counters()
    assert c["compiled_graphs"] == 3, c  # a, b, c: "a" stayed (used after b), "b" evicted
    assert c["evicted_programs"] == 1 and c["recompilations_new_layout"] == 2, c
    assert live_programs() - live0 == 2, c
    torch._dynamo.reset()
    assert live_programs() == live0


def test_replay_many_outputs(mode):
    """A graph with more outputs than the shim's first result buffer (64) replays after
    growing it."""
    def f(x):
        return tuple((x * i).sin() for i in range(70))

    cf = torch.compile(f, backend="tpu")
    x = torch.randn(3)
    xt = x.to("tpu")
    for _ in range(3):
        got = cf(xt)
        assert len(got) == 70
        for a, b in zip(got, f(x), strict=True):
            assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert compile_counters()["compiled_graphs"] == 1


@pytest.mark.usefixtures("exact_shapes")
def test_replay_keys_python_values():
    """Python ints among a graph's arguments (sizes under dynamic=True) are part of its key:
    one Dynamo graph, one program per value, equal values replay."""
    def f(x, n):
        return x[:n] * 2

    cf = torch.compile(f, backend="tpu", dynamic=True)
    x = torch.randn(6)
    xt = x.to("tpu")
    for n in (3, 4, 3, 5, 4):
        assert_close(cf(xt, n), f(x, n))
    c = compile_counters()
    assert c["dynamo_graphs"] == 1, c
    assert c["compiled_graphs"] == 3, c
    assert c["recompilations_new_shape"] == 2, c


def program_loads():
    m = torch_pjrt.metrics()
    return m["compilations"] + m.get("disk_hits", 0)


@pytest.mark.usefixtures("exact_shapes")
def test_reset_releases_programs(mode):
    """torch._dynamo.reset() frees every compiled program (executable and constants): the
    count of live programs drops back, and the same graph compiled again must load its
    executable again. A backward still pending across the reset captures again."""
    live0 = live_programs()
    w = torch.randn(4, 3)
    wt = w.to("tpu").requires_grad_()

    def f(x, w):
        return (x @ w).tanh().sum()

    cf = torch.compile(f, backend="tpu", dynamic=True)
    g = torch.Generator().manual_seed(0)
    # Not 3 or 4: Dynamo's duck sizing would tie the length to w's sizes at first.
    xs = [torch.randn(n, 4, generator=g) for n in (5, 6, 7)]
    for x in xs:
        cf(x.to("tpu"), wt).backward()
    pending = cf(xs[0].to("tpu"), wt)  # its backward runs after the reset
    n = compile_counters()["compiled_graphs"]
    assert n == 6 and live_programs() - live0 == n, compile_counters()
    torch._dynamo.reset()
    assert live_programs() == live0, compile_counters()
    assert compile_counters()["released_programs"] == n, compile_counters()
    wt.grad = None
    pending.backward()
    wc = w.clone().requires_grad_()
    f(xs[0], wc).backward()
    assert_close(wt.grad, wc.grad, atol=1e-6, rtol=1e-5)
    assert compile_counters()["recompilations_released"] == 1, compile_counters()
    torch._dynamo.reset()
    assert live_programs() == live0
    # The executables left the in-memory program cache: the same calls load them again
    # (from the disk cache or by compiling), forward and backward.
    before = program_loads()
    cf = torch.compile(f, backend="tpu", dynamic=True)
    cf(xs[1].to("tpu"), wt).backward()
    assert program_loads() - before >= 2
    assert live_programs() - live0 == 2


@pytest.mark.usefixtures("exact_shapes")
def test_garbage_collected_graph_releases_programs():
    """A compiled graph nobody refers to any more frees its programs."""
    import gc

    from torch_pjrt.compile import tpu_backend

    def f(x, y):
        return ((x * y).sin() + 1,)

    x, y = torch.randn(5), torch.randn(5)
    gm = torch.fx.symbolic_trace(f)
    live0 = live_programs()
    fn = tpu_backend(gm, [x.to("tpu"), y.to("tpu")])
    for n in (5, 7):
        a, b = torch.randn(n), torch.randn(n)
        assert_close(fn(a.to("tpu"), b.to("tpu"))[0], f(a, b)[0])
    assert live_programs() - live0 == 2
    del fn
    gc.collect()
    assert live_programs() == live0


# ---------------------------------------------------------------------------
# mode= and options=
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("compile_mode", ["default", "reduce-overhead"])
def test_mode_accepted(compile_mode):
    def f(x):
        return torch.sin(x) * 2 + 1

    x = torch.randn(5)
    cf = torch.compile(f, backend="tpu", mode=compile_mode)
    assert_close(cf(x.to("tpu")), f(x))
    assert compile_counters()["compiled_graphs"] == 1


def test_dump_option(capsys):
    cf = torch.compile(lambda x: x * 3, backend="tpu", options={"dump_stablehlo": True})
    cf(torch.ones(3, device="tpu"))
    assert "stablehlo.multiply" in capsys.readouterr().out


def test_core_decompositions_option():
    """options={"decompositions": "core"}: PyTorch's core decompositions for ops without a
    lowering; same results."""
    cpu_model, tpu_model, compiled, (x, y), (xt, yt), loss_fn = pair(
        "cnn_train", options={"decompositions": "core"})
    loss_fn(cpu_model(x), y).backward()
    loss_fn(compiled(xt), yt).backward()
    assert_state_close(tpu_model, cpu_model)
    assert_captured()


@pytest.mark.parametrize("kw", [{"options": {"no_such_option": 1}}, {"mode": "no-such-mode"},
                                {"options": {"decompositions": "no-such"}}],
                         ids=["options", "mode", "decompositions"])
def test_bad_option_raises_value_error(kw):
    cf = torch.compile(lambda x: x + 1, backend="tpu", **kw)
    with pytest.raises(ValueError, match="no.such"):
        cf(torch.ones(3, device="tpu"))


def test_bad_max_programs_raises_value_error():
    cf = torch.compile(lambda x: x + 1, backend="tpu", options={"max_programs": 0})
    with pytest.raises(ValueError, match="max_programs"):
        cf(torch.ones(3, device="tpu"))


def test_fullgraph_untraceable_raises():
    def f(x):
        if x.sum() > 0:  # data-dependent control flow: Dynamo must break the graph here
            return x + 1
        return x - 1

    cf = torch.compile(f, backend="tpu", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        cf(torch.ones(3, device="tpu"))
    # Without fullgraph, the same function runs (in pieces) and is right.
    torch._dynamo.reset()
    cf = torch.compile(f, backend="tpu")
    for sign in (1, -1):
        x = torch.full((3,), float(sign))
        assert_close(cf(x.to("tpu")), f(x))


# ---------------------------------------------------------------------------
# Inputs the programs see
# ---------------------------------------------------------------------------


def test_views_and_aliased_inputs(mode):
    """Inputs that are views of bigger storages, and two inputs sharing one storage: a
    program captured for one layout must not be replayed on another."""

    def f(a, b):
        return a * 2 + b

    cf = torch.compile(f, backend="tpu", dynamic=False)
    g = torch.Generator().manual_seed(0)
    tb, u, v = (torch.randn(6, 8, generator=g).to("tpu") for _ in range(3))
    # Same shapes, strides and offsets, different storage sizes / aliasing each call.
    cases = [
        (tb[:3], tb[3:]),                      # both views of one storage
        (u[:3], v[3:]),                        # the same views of two storages
        (tb[:3].clone(), tb[3:].clone()),      # separate storages
        (tb[:3], tb[:3]),                      # the same tensor twice
        (u[:3], u[:3].clone()),
        (torch.cat([tb, tb])[:3], tb[3:]),     # a view of a bigger storage
    ]
    for a, b in cases:
        assert_close(cf(a, b), f(to_cpu(a), to_cpu(b)))


# ---------------------------------------------------------------------------
# export_stablehlo
# ---------------------------------------------------------------------------


def run_exported(text, device=0):
    """Runs the last export's program through the PJRT plugin directly; returns its results."""
    from torch_pjrt.compile import _DTYPE, export_signature

    params, results = export_signature()
    assert all(p is not None for p in params), "the program reads values fixed at export"
    ins = [(p.untyped_storage().data_ptr(), _DTYPE[p.dtype]) for p in params]
    outs = [torch.empty(r.shape, dtype=r.dtype, device="tpu") if isinstance(r, torch.Tensor)
            else torch.empty(r[1], dtype=r[0], device="tpu") for r in results]
    torch_pjrt._C.run_mlir(text, device, ins, [(o.untyped_storage().data_ptr(), _DTYPE[o.dtype]) for o in outs])
    return outs


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0, 4.0]))

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale, x.sum(dim=0)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_export_stablehlo_module(mode, grad):
    torch.manual_seed(0)
    m = Small()
    mt = copy.deepcopy(m).to("tpu")
    x = torch.randn(3, 8)
    with torch.set_grad_enabled(grad):
        text = torch_pjrt.export_stablehlo(mt, x.to("tpu"))
    assert text.startswith("module") and "func.func public @main" in text
    assert "stablehlo.tanh" in text and "stablehlo.dot_general" in text
    from torch_pjrt.compile import _last_export, export_signature

    pid = _last_export[0]
    order = torch_pjrt._C.captured_inputs(pid)
    params, results = export_signature()
    # Every parameter is the input, a weight or the buffer; each read once.
    assert sorted(order) == list(range(len(order))) and len(order) == 4, order
    # The program's results, run directly, and the export run's own results agree with eager.
    with torch.no_grad():
        want = m(x)
    outs = run_exported(text)
    for got in (outs[:2], results[:2]):
        assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
        assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)
    # Run again on new inputs: the program reads the storages it is given.
    x2 = torch.randn(3, 8)
    params[order.index(0)].copy_(x2.to("tpu"))
    with torch.no_grad():
        want2 = m(x2)
    outs = run_exported(text)
    assert_close(outs[0], want2[0], atol=1e-6, rtol=1e-5)
    assert_close(outs[1], want2[1], atol=1e-6, rtol=1e-5)


def test_export_stablehlo_function(mode):
    def f(a, b):
        return (a @ b).relu().sum(dim=-1), torch.where(a > 0, a, b[:, :2].t())

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, generator=g), torch.randn(3, 2, generator=g)
    text = torch_pjrt.export_stablehlo(f, a.to("tpu"), b.to("tpu"))
    outs = run_exported(text)
    want = f(a, b)
    assert_close(outs[0], want[0], atol=1e-6, rtol=1e-5)
    assert_close(outs[1], want[1])


def test_export_stablehlo_rejects_cpu_inputs():
    with pytest.raises(ValueError, match="tpu"):
        torch_pjrt.export_stablehlo(lambda x: x + 1, torch.ones(3))


def test_export_result_types():
    from torch_pjrt.compile import _result_types

    text = "func.func public @main(%v0: tensor<24xf32>) -> (tensor<24xf32>, tensor<i64>, tensor<2x3xi1>) {"
    assert _result_types(text) == [(torch.float32, [24]), (torch.int64, []), (torch.bool, [2, 3])]
    text = "func.func public @main(%v0: tensor<4xbf16>) -> tensor<4xbf16> {"
    assert _result_types(text) == [(torch.bfloat16, [4])]


def test_graph_with_cpu_output_runs_eagerly():
    """A graph returning a CPU tensor cannot be one tpu program: it runs eagerly (counted
    once as a graph break, then as eager calls), right, and leaves no program behind."""
    def f(x):
        return (x.sin() * 2).cpu() + 1

    cf = torch.compile(f, backend="tpu")
    x = torch.randn(5)
    live0 = live_programs()
    for _ in range(3):
        got = cf(x.to("tpu"))
        assert got.device.type == "cpu"
        assert_close(got, f(x))
    c = compile_counters()
    assert c["graph_breaks"] == 1 and c["eager_graph_calls"] == 2, c
    assert live_programs() == live0, c
