"""torchvision's detection ops on tpu (`nms`, `roi_align` and its backward): lowered, not
run on the CPU fallback; torchvision's CPU kernels are the oracle, errors included."""

import pytest
import torch
from conftest import assert_close, fallbacks

import torch_pjrt

tv_ops = pytest.importorskip("torchvision.ops")


def _boxes(n, spread=100.0, size=40.0):
    xy = torch.rand(n, 2) * spread
    return torch.cat([xy, xy + torch.rand(n, 2) * size], 1)


@pytest.mark.parametrize("n", [0, 1, 7, 300])
@pytest.mark.parametrize("thr", [0.0, 0.3, 0.7, 1.0])
def test_nms_keeps_the_cpus_boxes(eager_mode, seed, n, thr):
    boxes, scores = _boxes(n), torch.rand(n)
    scores[: n // 3] = 0.5  # ties: the stable order decides
    torch_pjrt.reset_metrics()
    got = tv_ops.nms(boxes.to("tpu"), scores.to("tpu"), thr)
    assert got.device.type == "tpu"
    assert torch.equal(got.cpu(), tv_ops.nms(boxes, scores, thr))
    assert fallbacks() == {}


def test_nms_float64_with_tied_overlaps(seed):
    # Quantized coordinates make exact ties between overlaps and the threshold.
    boxes, scores = (_boxes(60) / 4).round().double(), torch.rand(60).double()
    got = tv_ops.nms(boxes.to("tpu"), scores.to("tpu"), 0.4).cpu()
    assert torch.equal(got, tv_ops.nms(boxes, scores, 0.4))


def test_batched_nms_as_detection_heads_call_it(seed):
    boxes, scores, labels = _boxes(500), torch.rand(500), torch.randint(0, 5, (500,))
    want = tv_ops.batched_nms(boxes, scores, labels, 0.5)
    got = tv_ops.batched_nms(boxes.to("tpu"), scores.to("tpu"), labels.to("tpu"), 0.5)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize(
    "boxes,scores,msg",
    [
        (torch.rand(4), torch.rand(4), "boxes should be a 2d tensor, got 1D"),
        (torch.rand(4, 3), torch.rand(4), "boxes should have 4 elements in dimension 1, got 3"),
        (torch.rand(4, 4), torch.rand(4, 1), "scores should be a 1d tensor, got 2D"),
        (torch.rand(4, 4), torch.rand(3), "boxes and scores should have same number"),
    ],
)
def test_nms_errors_are_the_cpus(boxes, scores, msg):
    with pytest.raises(RuntimeError, match=msg):
        tv_ops.nms(boxes, scores, 0.5)
    with pytest.raises(RuntimeError, match=msg):
        tv_ops.nms(boxes.to("tpu"), scores.to("tpu"), 0.5)


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "BFloat16"), (torch.float16, "Half")])
def test_nms_half_precision_raises_as_on_the_cpu(dtype, name):
    b, s = _boxes(5).to(dtype), torch.rand(5).to(dtype)
    with pytest.raises(RuntimeError, match=f"not implemented for '{name}'"):
        tv_ops.nms(b, s, 0.5)
    with pytest.raises(RuntimeError, match=f"not implemented for '{name}'"):
        tv_ops.nms(b.to("tpu"), s.to("tpu"), 0.5)


def _rois(k, n_images, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n_images, (k, 1), generator=g).float()
    # Some rois reach past the map's borders, where samples are zero.
    xy = torch.rand(k, 2, generator=g) * 70 - 6
    return torch.cat([idx, xy, xy + torch.rand(k, 2, generator=g) * 30], 1)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("scale,ratio,out", [(0.25, 2, (3, 4)), (0.5, 1, 7), (1 / 8, 3, (2, 5))])
def test_roi_align_forward_and_backward(eager_mode, seed, aligned, scale, ratio, out):
    x = torch.randn(2, 5, 13, 17, requires_grad=True)
    rois = _rois(9, 2)
    want = tv_ops.roi_align(x, rois, out, scale, ratio, aligned)
    xt = x.detach().to("tpu").requires_grad_()
    torch_pjrt.reset_metrics()
    got = tv_ops.roi_align(xt, rois.to("tpu"), out, scale, ratio, aligned)
    assert_close(got, want)
    g = torch.randn_like(want)
    (gw,) = torch.autograd.grad(want, x, g)
    (gg,) = torch.autograd.grad(got, xt, g.to("tpu"))
    assert_close(gg, gw)
    assert fallbacks() == {}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_roi_align_other_dtypes_and_no_rois(seed, dtype):
    x = torch.randn(1, 3, 8, 8, dtype=dtype)
    rois = (_rois(4, 1) / 8).to(dtype)
    args = ((2, 2), 1.0, 2, True)
    assert_close(tv_ops.roi_align(x.to("tpu"), rois.to("tpu"), *args),
                 tv_ops.roi_align(x, rois, *args))
    empty = torch.zeros(0, 5, dtype=dtype)
    got = tv_ops.roi_align(x.to("tpu"), empty.to("tpu"), *args)
    assert got.shape == (0, 3, 2, 2)


def test_roi_align_bfloat16_raises_as_on_the_cpu():
    x, rois = torch.randn(1, 2, 8, 8).bfloat16(), _rois(2, 1).bfloat16()
    with pytest.raises(RuntimeError, match="not implemented for 'BFloat16'"):
        tv_ops.roi_align(x, rois, 2, 1.0, 2)
    with pytest.raises(RuntimeError, match="not implemented for 'BFloat16'"):
        tv_ops.roi_align(x.to("tpu"), rois.to("tpu"), 2, 1.0, 2)


def test_roi_align_adaptive_grid_runs_on_the_cpu(seed):
    # sampling_ratio 0: each roi's grid size is its own (data-dependent shapes).
    x, rois = torch.randn(2, 4, 16, 16), _rois(5, 2)
    torch_pjrt.reset_metrics()
    got = tv_ops.roi_align(x.to("tpu"), rois.to("tpu"), 3, 0.5, 0, False)
    assert_close(got, tv_ops.roi_align(x, rois, 3, 0.5, 0, False))
    assert fallbacks() == {"torchvision::roi_align": 1}


def test_roi_align_bad_rois_raise_as_on_the_cpu():
    # The op itself (torchvision's Python wrapper asserts before it).
    op = torch.ops.torchvision.roi_align
    x, rois = torch.randn(1, 2, 8, 8), torch.rand(3, 4)
    with pytest.raises(RuntimeError, match=r"rois must have shape as Tensor\[K, 5\]"):
        op(x, rois, 1.0, 2, 2, 2, False)
    with pytest.raises(RuntimeError, match=r"rois must have shape as Tensor\[K, 5\]"):
        op(x.to("tpu"), rois.to("tpu"), 1.0, 2, 2, 2, False)


def test_multiscale_roi_align_as_faster_rcnn_pools(seed):
    pool = tv_ops.MultiScaleRoIAlign(["0", "1"], 7, 2)
    feats = {"0": torch.randn(2, 8, 32, 32), "1": torch.randn(2, 8, 16, 16)}
    boxes = [_boxes(20, 100, 60), _boxes(11, 100, 60)]
    sizes = [(128, 128)] * 2
    want = pool(feats, boxes, sizes)
    got = pool({k: v.to("tpu") for k, v in feats.items()}, [b.to("tpu") for b in boxes], sizes)
    assert_close(got, want)
