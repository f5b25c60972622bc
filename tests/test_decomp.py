"""Matrix decompositions (rules/decomp.rs) against the CPU: LU and what builds on it
(det, slogdet, inv, solve, lu_solve, lu_unpack), QR, geqrf, Householder products, eigh
and SVD. Eigen- and singular vectors are only defined up to sign: those compare |V| and
products that do not depend on the sign."""

import pytest
import torch
from conftest import compare, fallbacks, to_tpu

import torch_pjrt

DTYPES = [torch.float32, torch.float64]
SQUARE = [(3, 3), (1, 1), (5, 5), (2, 4, 4), (2, 3, 6, 6), (0, 3, 3), (0, 0), (2, 0, 0), (16, 16)]
RECT = [(3, 5), (5, 3), (2, 4, 7), (2, 7, 4), (0, 4), (4, 0)]


def tol(dtype, scale=1.0):
    t = 1e-4 if dtype == torch.float32 else 1e-10
    return dict(atol=t * scale, rtol=t * scale)


def native(fn, *args, **kwargs):
    """(cpu result, tpu result on the CPU) of fn; the tpu run must not fall back."""
    t_args, t_kwargs = to_tpu((args, kwargs))
    torch_pjrt.reset_metrics()
    actual = fn(*t_args, **t_kwargs)
    fb = fallbacks()
    assert not fb, f"ran on the CPU fallback: {fb}"
    expected = fn(*args, **kwargs)
    to_cpu = lambda r: tuple(x.cpu() for x in r) if isinstance(r, tuple) else r.cpu()  # noqa: E731
    return expected, to_cpu(actual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SQUARE + RECT, ids=str)
def test_lu(shape, dtype, seed):
    a = torch.randn(shape, dtype=dtype)
    compare(torch.linalg.lu_factor_ex, a, check_fallback=True, **tol(dtype))
    compare(torch.linalg.lu, a, check_fallback=True, **tol(dtype))
    lu, piv = torch.linalg.lu_factor(a)
    compare(torch.lu_unpack, lu, piv, check_fallback=True, **tol(dtype))
    compare(lambda x, p: torch.lu_unpack(x, p, unpack_data=False), lu, piv, check_fallback=True)
    compare(lambda x, p: torch.lu_unpack(x, p, unpack_pivots=False), lu, piv,
            check_fallback=True, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SQUARE, ids=str)
def test_det_inv_solve(shape, dtype, seed):
    a = torch.randn(shape, dtype=dtype)
    b = torch.randn(shape[:-1] + (2,), dtype=dtype)
    compare(torch.linalg.det, a, check_fallback=True, **tol(dtype))
    compare(torch.linalg.slogdet, a, check_fallback=True, **tol(dtype))
    compare(torch.linalg.inv_ex, a, check_fallback=True, **tol(dtype))
    compare(torch.linalg.solve, a, b, check_fallback=True, **tol(dtype))
    compare(lambda x, y: torch.linalg.solve(x, y.mT, left=False), a, b, check_fallback=True,
            **tol(dtype))
    compare(torch.linalg.solve_ex, a, torch.randn(shape[:-1], dtype=dtype), check_fallback=True,
            **tol(dtype))
    lu, piv = torch.linalg.lu_factor(a)
    for left in (True, False):
        for adjoint in (True, False):
            rhs = b if left else b.mT
            compare(lambda x, p, y, left=left, adjoint=adjoint:
                    torch.linalg.lu_solve(x, p, y, left=left, adjoint=adjoint),
                    lu, piv, rhs, check_fallback=True, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_solve_broadcasts(dtype, seed):
    a = torch.randn(2, 1, 3, 3, dtype=dtype)
    b = torch.randn(4, 3, 2, dtype=dtype)
    compare(torch.linalg.solve, a, b, check_fallback=True, **tol(dtype))
    lu, piv = torch.linalg.lu_factor(a)
    compare(torch.linalg.lu_solve, lu, piv, b, check_fallback=True, **tol(dtype))
    compare(torch.linalg.solve_ex, torch.randn(2, 3, 3, dtype=dtype), torch.randn(3, dtype=dtype),
            check_fallback=True, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_singular(dtype):
    # Exactly singular: det 0, slogdet (0, -inf), info > 0 as LAPACK reports it.
    for a in (torch.ones(3, 3, dtype=dtype), torch.zeros(2, 3, 3, dtype=dtype),
              torch.tensor([[0., 1, 0], [0, 0, 0], [0, 0, 1]], dtype=dtype)):
        compare(torch.linalg.det, a, check_fallback=True)
        compare(torch.linalg.slogdet, a, check_fallback=True)
        compare(torch.linalg.lu_factor_ex, a, check_fallback=True)
        compare(lambda x: torch.linalg.inv_ex(x).info, a, check_fallback=True)
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.inv(torch.zeros(3, 3, device="tpu"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ill_conditioned_residuals(dtype, seed):
    """Both backward stable: relative residuals at the CPU's level."""
    usv = torch.linalg.svd(torch.randn(6, 6, dtype=dtype))
    a = usv.U @ torch.diag(torch.logspace(0, -5 if dtype == torch.float32 else -12, 6,
                                          dtype=dtype)) @ usv.Vh
    b = torch.randn(6, 3, dtype=dtype)
    eps = torch.finfo(dtype).eps
    for fn, rhs in ((lambda x: torch.linalg.solve(x, b.to(x.device)), b),
                    (torch.linalg.inv, torch.eye(6, dtype=dtype))):
        x = fn(a.to("tpu")).cpu().double()
        res = (a.double() @ x - rhs.double()).norm() / (a.double().norm() * x.norm())
        assert res < 20 * eps


def test_det_backward_contiguous(seed):
    # The CPU's det/slogdet factor A^T for contiguous A and their backward expects that.
    a = torch.randn(3, 5, 5, dtype=torch.float64, requires_grad=True)
    for fn in (torch.linalg.det, lambda x: torch.linalg.slogdet(x).logabsdet, torch.logdet):
        x = a.detach().abs() + 5 * torch.eye(5, dtype=torch.float64) if fn is torch.logdet else a
        x = x.detach().requires_grad_()
        compare(lambda t, fn=fn: torch.autograd.grad(fn(t).sum(), t)[0], x, check_fallback=True,
                **tol(torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 3), (1, 1), (5, 3), (3, 5), (2, 4, 4), (2, 6, 3),
                                   (2, 3, 6), (0, 3, 3), (0, 0), (3, 0), (0, 3), (2, 0, 4),
                                   (33, 33), (40, 20)], ids=str)
def test_qr(shape, dtype, seed):
    a = torch.randn(shape, dtype=dtype)
    for mode in ("reduced", "complete", "r"):
        compare(lambda x, mode=mode: torch.linalg.qr(x, mode=mode), a, check_fallback=True, **tol(dtype))
    compare(torch.geqrf, a, check_fallback=True, **tol(dtype))
    if shape[-2] >= shape[-1]:
        g, tau = torch.geqrf(a)
        compare(torch.linalg.householder_product, g, tau, check_fallback=True, **tol(dtype))
        if tau.shape[-1] >= 2:
            compare(torch.linalg.householder_product, g, tau[..., :-1].contiguous(),
                    check_fallback=True, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 3), (1, 1), (2, 4, 4), (0, 3, 3), (0, 0), (33, 33)],
                         ids=str)
@pytest.mark.parametrize("uplo", ["L", "U"])
def test_eigh(shape, dtype, uplo, seed):
    a = torch.randn(shape, dtype=dtype)
    (w0, v0), (w, v) = native(torch.linalg.eigh, a, UPLO=uplo)
    torch.testing.assert_close(w, w0, **tol(dtype, 10))
    torch.testing.assert_close(v.abs(), v0.abs(), **tol(dtype, 10))
    compare(lambda x: torch.linalg.eigvalsh(x, UPLO=uplo), a, check_fallback=True,
            **tol(dtype, 10))


@pytest.mark.parametrize("dtype", DTYPES)
def test_eigh_repeated_eigenvalues(dtype):
    a = torch.diag(torch.tensor([1., 1, 2, 2, 3], dtype=dtype))
    q, _ = torch.linalg.qr(torch.randn(5, 5, dtype=dtype, generator=torch.Generator().manual_seed(0)))
    a = q @ a @ q.mT
    (w0, _), (w, v) = native(torch.linalg.eigh, a)
    torch.testing.assert_close(w, w0, **tol(dtype, 10))
    torch.testing.assert_close(a @ v, v * w, **tol(dtype, 10))
    torch.testing.assert_close(v.mT @ v, torch.eye(5, dtype=dtype), **tol(dtype, 10))


def svd_parts(usv):
    u, s, vh = usv
    k = s.shape[-1]
    u, vh = u[..., :k], vh[..., :k, :]
    return s, u.abs(), vh.abs(), (u * s.unsqueeze(-2)) @ vh


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 3), (1, 1), (5, 3), (3, 5), (2, 4, 4), (2, 6, 3),
                                   (2, 3, 6), (0, 3, 3), (0, 0), (3, 0), (0, 3), (2, 0, 4),
                                   (33, 33), (40, 20)], ids=str)
@pytest.mark.parametrize("full", [True, False])
def test_svd(shape, dtype, full, seed):
    a = torch.randn(shape, dtype=dtype)
    expected, actual = native(torch.linalg.svd, a, full_matrices=full)
    for x, y in zip(actual, expected, strict=True):
        assert x.shape == y.shape
    for x, y in zip(svd_parts(actual), svd_parts(expected), strict=True):
        torch.testing.assert_close(x, y, **tol(dtype, 10))
    u, _, vh = actual
    eye = lambda n: torch.eye(n, dtype=dtype)  # noqa: E731
    torch.testing.assert_close(u.mT @ u, eye(u.shape[-1]).expand(u.mT.shape[:-1] + (u.shape[-1],)),
                               **tol(dtype, 10))
    torch.testing.assert_close(vh @ vh.mT, eye(vh.shape[-2]).expand(vh.shape[:-1] + (vh.shape[-2],)),
                               **tol(dtype, 10))
    compare(torch.linalg.svdvals, a, check_fallback=True, **tol(dtype, 10))


@pytest.mark.parametrize("dtype", DTYPES)
def test_svd_special(dtype, seed):
    rank2 = torch.randn(6, 2, dtype=dtype) @ torch.randn(2, 5, dtype=dtype)
    usv = torch.linalg.svd(torch.randn(6, 6, dtype=dtype))
    ill = usv.U @ torch.diag(torch.logspace(0, -5 if dtype == torch.float32 else -12, 6,
                                            dtype=dtype)) @ usv.Vh
    for a in (torch.zeros(4, 3, dtype=dtype), rank2, ill, torch.eye(4, dtype=dtype),
              torch.randn(3, 4, dtype=dtype) * 1e18, torch.randn(3, 4, dtype=dtype) * 1e-30):
        compare(torch.linalg.svdvals, a, check_fallback=True, **tol(dtype, 10))
        _, (u, s, vh) = native(torch.linalg.svd, a, full_matrices=False)
        scale = a.abs().max().clamp(min=torch.finfo(dtype).tiny)
        torch.testing.assert_close(((u * s.unsqueeze(-2)) @ vh) / scale, a / scale,
                                   **tol(dtype, 10))
        k = s.shape[-1]
        torch.testing.assert_close(u.mT @ u, torch.eye(k, dtype=dtype), **tol(dtype, 10))
        torch.testing.assert_close(vh @ vh.mT, torch.eye(k, dtype=dtype), **tol(dtype, 10))


def _raise_info(fn, args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        return type(e), str(e).split("\n")[0]
    return None


ERRORS = {
    "lu_factor_int": (torch.linalg.lu_factor_ex, lambda d: [torch.ones(3, 3, dtype=torch.long, device=d)]),
    "lu_factor_1d": (torch.linalg.lu_factor_ex, lambda d: [torch.ones(3, device=d)]),
    "lu_factor_half": (torch.linalg.lu_factor_ex, lambda d: [torch.ones(3, 3, dtype=torch.half, device=d)]),
    "lu_nopivot": (lambda a: torch.linalg.lu(a, pivot=False), lambda d: [torch.ones(3, 3, device=d)]),
    "inv_rect": (torch.linalg.inv_ex, lambda d: [torch.ones(3, 4, device=d)]),
    "inv_half": (torch.linalg.inv_ex, lambda d: [torch.ones(3, 3, dtype=torch.half, device=d)]),
    "det_int": (torch.linalg.det, lambda d: [torch.ones(3, 3, dtype=torch.long, device=d)]),
    "slogdet_1d": (torch.linalg.slogdet, lambda d: [torch.ones(3, device=d)]),
    "solve_dtype": (torch.linalg.solve_ex, lambda d: [torch.ones(3, 3, device=d),
                                                     torch.ones(3, dtype=torch.float64, device=d)]),
    "solve_shapes": (torch.linalg.solve_ex, lambda d: [torch.ones(3, 3, device=d), torch.ones(4, device=d)]),
    "solve_batch": (torch.linalg.solve_ex, lambda d: [torch.ones(2, 3, 3, device=d),
                                                     torch.ones(4, 3, 2, device=d)]),
    "lu_solve_pivots": (torch.linalg.lu_solve, lambda d: [torch.ones(3, 3, device=d),
                                                         torch.ones(3, dtype=torch.long, device=d),
                                                         torch.ones(3, 2, device=d)]),
    "lu_solve_left": (lambda a, p, b: torch.linalg.lu_solve(a, p, b, left=False),
                      lambda d: [torch.ones(3, 3, device=d), torch.ones(3, dtype=torch.int32, device=d),
                                 torch.ones(3, 2, device=d)]),
    "lu_unpack_pivots": (torch.lu_unpack, lambda d: [torch.ones(3, 3, device=d),
                                                    torch.ones(2, dtype=torch.int32, device=d)]),
    "eigh_uplo": (lambda a: torch.linalg.eigh(a, UPLO="X"), lambda d: [torch.ones(3, 3, device=d)]),
    "eigh_int": (torch.linalg.eigh, lambda d: [torch.ones(3, 3, dtype=torch.long, device=d)]),
    "qr_mode": (lambda a: torch.linalg.qr(a, mode="foo"), lambda d: [torch.ones(3, 3, device=d)]),
    "geqrf_1d": (torch.geqrf, lambda d: [torch.ones(3, device=d)]),
    "householder_wide": (torch.linalg.householder_product, lambda d: [torch.ones(3, 5, device=d),
                                                                     torch.ones(2, device=d)]),
    "householder_tau_batch": (torch.linalg.householder_product,
                              lambda d: [torch.ones(2, 5, 3, device=d), torch.ones(3, 2, device=d)]),
    "svd_int": (torch.linalg.svd, lambda d: [torch.ones(3, 3, dtype=torch.long, device=d)]),
    "svd_driver": (lambda a: torch.linalg.svd(a, driver="gesvd"), lambda d: [torch.ones(3, 3, device=d)]),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors(name):
    fn, make = ERRORS[name]
    expected = _raise_info(fn, make("cpu"))
    assert expected is not None
    assert _raise_info(fn, make("tpu")) == expected


@pytest.mark.parametrize("fn", [torch.linalg.det, lambda x: torch.linalg.slogdet(x)[1],
                                torch.logdet], ids=["det", "slogdet", "logdet"])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_det_gradient_follows_the_layout(fn, transposed):
    # The CPU factors A^T for contiguous A and A otherwise; the backward uses those factors.
    a = torch.randn(2, 4, 4, dtype=torch.float64) + 4 * torch.eye(4, dtype=torch.float64)
    a = a.mT if transposed else a
    t = a.to("tpu")
    t = t.mT.contiguous().mT if transposed else t
    assert t.is_contiguous() == a.is_contiguous()
    a.requires_grad_()
    t.requires_grad_()
    (g,) = torch.autograd.grad(fn(a).sum(), a)
    (gt,) = torch.autograd.grad(fn(t).sum(), t)
    torch.testing.assert_close(gt.cpu(), g, **tol(torch.float64))
