"""torch.tpu.pallas: JAX and Pallas kernels on tpu tensors, against PyTorch on the CPU."""

import enum
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import assert_close, fallbacks

import torch_pjrt

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # jax traces on the host, as torch.tpu.pallas does
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pl = pytest.importorskip("jax.experimental.pallas")
P = torch.tpu.pallas


@P.custom_jax_kernel
def softmax_mul(x, y):
    return {"a": jax.nn.softmax(x, axis=-1) * y, "b": (x.sum(), jnp.tanh(y))}


def softmax_mul_ref(x, y):
    return {"a": torch.softmax(x, -1) * y, "b": (x.sum(), torch.tanh(y))}


def _add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + 2 * y_ref[...]


def _add_backward(args, g):
    return g, 2 * g


@P.custom_jax_kernel(backward=_add_backward)
def pallas_add(x, y):
    spec = pl.BlockSpec((8, 64), lambda i, j: (i, j))
    return pl.pallas_call(
        _add_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // 8, x.shape[1] // 64),
        in_specs=[spec, spec],
        out_specs=spec,
    )(x, y)


class Act(enum.Enum):
    TANH = "tanh"
    RELU = "relu"


def _scaled(x, power, scale, *, act):
    y = x**power * scale
    return jnp.tanh(y) if act is Act.TANH else jax.nn.relu(y)


scaled = P.custom_jax_kernel(_scaled, static_argnums=(1,), static_argnames=("act",))


def test_plain_kernel_with_a_pytree_output(eager_mode, seed):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch_pjrt.reset_metrics()
    out = softmax_mul(x.to("tpu"), y.to("tpu"))
    assert not fallbacks()
    assert isinstance(out, dict) and isinstance(out["b"], tuple)
    assert out["a"].device.type == "tpu"
    assert_close(out, softmax_mul_ref(x, y))


def test_kernel_fuses_with_the_ops_around_it(eager_mode, seed):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    xt, yt = x.to("tpu"), y.to("tpu")
    torch.tpu.synchronize()
    torch_pjrt.reset_metrics()
    out = softmax_mul(xt * 2 + 1, yt)["a"].relu() - xt
    got = out.cpu()
    if eager_mode == torch.tpu.EagerMode.DEFER_AND_FUSE:
        # Recorded into the pending graph: one program for the ops and the kernel.
        assert torch_pjrt.metrics()["flushes"] == 1
    assert_close(got, softmax_mul_ref(x * 2 + 1, y)["a"].relu() - x)


def test_views_and_in_place_ops_on_inputs_and_outputs(eager_mode, seed):
    x, y = torch.randn(8, 4), torch.randn(4, 8)
    xt, yt = x.to("tpu"), y.to("tpu")
    out = softmax_mul(xt.t(), yt[:, :])  # a transposed view in
    a = out["a"]
    a[1:3].mul_(2)  # in place on a view of an output
    a.add_(1)
    want = softmax_mul_ref(x.t(), y)["a"]
    want[1:3].mul_(2)
    want.add_(1)
    assert_close(a, want)
    # An output written in place is an ordinary tensor: the kernel reads it again.
    assert_close(softmax_mul(a, yt)["a"], softmax_mul_ref(want, y)["a"])


def test_static_arguments_and_python_numbers(eager_mode, seed):
    x = torch.randn(3, 5)
    xt = x.to("tpu")
    scaled = P.custom_jax_kernel(_scaled, static_argnums=(1,), static_argnames=("act",))
    for power, scale, act in [(2, 0.5, Act.TANH), (3, 0.5, Act.RELU), (2, -1.5, Act.TANH)]:
        y = x**power * scale
        want = torch.tanh(y) if act is Act.TANH else torch.relu(y)
        assert_close(scaled(xt, power, scale, act=act), want)
    # A new Python number is an input, not a new kernel; a new static value is.
    k = scaled.kernel
    n = len(k._traced)
    scaled(xt, 2, 7.0, act=Act.TANH)
    assert len(k._traced) == n
    scaled(xt, 4, 7.0, act=Act.TANH)
    assert len(k._traced) == n + 1


def test_bfloat16_and_integer_inputs(eager_mode):
    @P.custom_jax_kernel
    def gather_scale(table, idx):
        return table[idx] * jnp.bfloat16(3)

    table = torch.randn(10, 4).to(torch.bfloat16)
    idx = torch.tensor([3, 0, 9, 3])
    out = gather_scale(table.to("tpu"), idx.to("tpu"))
    assert out.dtype == torch.bfloat16
    assert_close(out, table[idx] * 3)


def test_pallas_kernel_in_interpret_mode(eager_mode, seed):
    x, y = torch.randn(16, 128), torch.randn(16, 128)
    assert_close(pallas_add(x.to("tpu"), y.to("tpu")), x + 2 * y)


def test_derived_vjp_matches_autograd(eager_mode, seed):
    x, y = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    yt = y.detach().to("tpu").requires_grad_()
    o = softmax_mul(xt, yt)
    (o["a"] * o["b"][1]).sum().add(o["b"][0] * 3).backward()
    r = softmax_mul_ref(x, y)
    (r["a"] * r["b"][1]).sum().add(r["b"][0] * 3).backward()
    assert_close(xt.grad, x.grad)
    assert_close(yt.grad, y.grad)


def test_explicit_backward(eager_mode, seed):
    x = torch.randn(16, 128, requires_grad=True)
    y = torch.randn(16, 128, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    yt = y.detach().to("tpu").requires_grad_()
    w = torch.randn(16, 128)
    (pallas_add(xt, yt) * w.to("tpu")).sum().backward()
    ((x + 2 * y) * w).sum().backward()
    assert_close(xt.grad, x.grad)
    assert_close(yt.grad, y.grad)


class _Block(torch.nn.Module):
    def __init__(self, kernel):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.kernel = kernel

    def forward(self, x, y):
        return self.kernel(self.lin(x), y)["a"].sum()


def test_compiled_training_has_the_kernel_in_its_graph(seed):
    torch._dynamo.reset()
    cpu = _Block(softmax_mul_ref)
    tpu = _Block(softmax_mul).to("tpu")
    tpu.load_state_dict(cpu.state_dict())
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.1)
    opt_t = torch.optim.SGD(tpu.parameters(), lr=0.1)
    step = torch.compile(tpu, backend="tpu")
    torch._dynamo.utils.counters.clear()
    for _ in range(3):
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        lt = step(x.to("tpu"), y.to("tpu"))
        lt.backward()
        opt_t.step()
        opt_t.zero_grad()
        lc = cpu(x, y)
        lc.backward()
        opt_c.step()
        opt_c.zero_grad()
        assert_close(lt, lc, atol=1e-5, rtol=1e-5)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert_close(tpu.lin.weight, cpu.lin.weight, atol=1e-5, rtol=1e-5)


def _rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


rms_norm = P.jax_op("pallas_test::rms_norm", _rms, static_argnums=(2,))


def test_jax_op_is_a_custom_op_in_compiled_and_exported_graphs(seed):
    x, w = torch.randn(4, 16), torch.randn(16)

    def ref(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w

    xt, wt = x.to("tpu"), w.to("tpu")
    assert_close(rms_norm(xt, wt, 1e-6), ref(x, w))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    f = torch.compile(lambda a, b: rms_norm(a * 2, b, 1e-6) + 1, backend="tpu")
    assert_close(f(xt, wt), ref(x * 2, w) + 1)
    assert not torch._dynamo.utils.counters["graph_break"]

    class M(torch.nn.Module):
        def forward(self, a, b):
            return rms_norm(a, b, 1e-6)

    ep = torch.export.export(M(), (xt, wt))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "pallas_test.rms_norm.default" in targets, targets
    xg = x.to("tpu").requires_grad_()
    rms_norm(xg, wt, 1e-6).sum().backward()
    xc = x.clone().requires_grad_()
    ref(xc, w).sum().backward()
    assert_close(xg.grad, xc.grad, atol=1e-5, rtol=1e-5)


# --- bad input ---------------------------------------------------------------------------


def test_bad_arguments_name_the_kernel_and_the_argument():
    xt = torch.randn(4, 8, device="tpu")
    softmax_mul(xt, xt)  # traced at (4, 8), whatever ran before
    with pytest.raises(ValueError, match=r"kernel 'softmax_mul': argument 1 is on cpu"):
        softmax_mul(xt, torch.randn(4, 8))
    with pytest.raises(TypeError, match=r"kernel 'softmax_mul': argument 1 is a str"):
        softmax_mul(xt, "y")
    with pytest.raises(TypeError, match="static argument 1 must be hashable"):
        scaled(xt, [2], 1.0, act=Act.TANH)
    with pytest.raises(TypeError, match="kernel 'softmax_mul' failed to trace"):
        softmax_mul(xt, torch.randn(3, 5, device="tpu"))
    before = xt.cpu()
    # The kernel id of one signature called with another: refused by the lowering rule.
    kid = next(iter(softmax_mul.kernel._traced.values())).id
    with pytest.raises(ValueError, match=r"kernel 'softmax_mul' was traced with argument 0 as f32\[4, 8\]"):
        torch.ops.torch_pjrt.jax_call([torch.ones(2, device="tpu"), xt], kid)
        torch.tpu.synchronize()
    assert_close(xt, before)
    # The op itself, reached directly with a CPU tensor: CUDA's device error, nothing copied.
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ops.torch_pjrt.jax_call([xt, torch.randn(4, 8)], kid)


def test_custom_calls_the_plugin_cannot_run_are_refused():
    @P.custom_jax_kernel
    def inverse(x):
        return jnp.linalg.inv(x)

    @P.custom_jax_kernel
    def host_callback(x):
        return jax.pure_callback(lambda a: a * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    if torch_pjrt._C.platform_name() != "cpu":
        pytest.skip("the CPU plugin's refusal")
    with pytest.raises(NotImplementedError, match="kernel 'inverse' calls the custom call 'lapack_"):
        inverse(torch.eye(3, device="tpu"))
    # JAX cannot export host callbacks at all.
    with pytest.raises(NotImplementedError, match="kernel 'host_callback' failed to trace: .*host_callbacks"):
        host_callback(torch.eye(3, device="tpu"))


def test_ops_newer_than_the_plugin_are_named(monkeypatch):
    from torch_pjrt import pallas

    @P.custom_jax_kernel
    def tangent(x):
        return jax.lax.tan(x)

    monkeypatch.setattr(pallas, "_plugin_stablehlo_version", lambda: "0.9.0")
    with pytest.raises(pallas.KernelError, match="kernel 'tangent' .*StableHLO 0.9.0.*tan"):
        tangent(torch.ones(3, device="tpu"))


def test_pallas_without_backward_says_so():
    x = torch.randn(16, 128, device="tpu", requires_grad=True)

    @P.custom_jax_kernel
    def no_bwd(x, y):
        return pallas_add.kernel.fn(x, y)

    # The same module as pallas_add's, without its backward.
    with pytest.raises(ValueError, match="pallas_call, need an explicit backward"):
        no_bwd(x, x.detach()).sum().backward()
    assert_close(pallas_add(x, x.detach()), x.detach().cpu() * 3)


# --- the trace cache ---------------------------------------------------------------------


def test_a_second_process_loads_the_kernel_without_jax(tmp_path):
    script = textwrap.dedent(
        """
        import sys, torch, torch_pjrt
        import kernels_mod
        x = torch.arange(12.0).reshape(3, 4).to("tpu")
        print(float(kernels_mod.k(x, 2.0).sum()), "jax" in sys.modules,
              torch_pjrt.cache_info()["compilations"])
        """
    )
    (tmp_path / "kernels_mod.py").write_text(
        textwrap.dedent(
            """
            import torch, torch_pjrt

            @torch.tpu.pallas.custom_jax_kernel
            def k(x, s):
                import jax.numpy as jnp
                return jnp.sin(x) * s
            """
        )
    )
    env = dict(os.environ, TORCH_TPU_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(tmp_path))
    runs = [
        subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr
    first, second = (r.stdout.split() for r in runs)
    want = float((torch.sin(torch.arange(12.0)) * 2).sum())
    assert abs(float(first[0]) - want) < 1e-4 and first[0] == second[0]
    assert first[1] == "True"  # traced
    assert second[1] == "False"  # loaded: jax never imported
    assert second[2] == "0"  # and the program came from the disk cache


def test_the_example_trains_with_its_kernels():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, os.path.join(root, "examples", "custom_kernel.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "inside torch.compile(backend='tpu'): OK" in r.stdout


def test_backward_with_static_arguments_and_integer_outputs(eager_mode, seed):
    def _bwd(args, g):
        x, scale, idx = args
        return g[0] * scale, None, None

    @P.custom_jax_kernel(static_argnums=1, backward=_bwd)
    def scale_and_argmax(x, scale, idx):
        return x * scale, jnp.argmax(x, axis=-1) + idx

    @P.custom_jax_kernel(static_argnums=1)
    def derived(x, scale, idx):
        return x * scale, jnp.argmax(x, axis=-1) + idx

    x = torch.randn(3, 4)
    idx = torch.tensor([1, 2, 3])
    for k in (scale_and_argmax, derived):
        xt = x.to("tpu").requires_grad_()
        y, am = k(xt, 3.0, idx.to("tpu"))
        assert am.dtype == torch.int32 or am.dtype == torch.int64
        assert_close(am.long(), x.argmax(-1) + idx)
        (y * y).sum().backward()
        assert_close(xt.grad, 2 * (x * 3) * 3)
