"""Programs that serve a range of sizes (torch_pjrt.set_shape_buckets): the CPU's results
at several sizes of one bucket, with no compilation after the bucket's first program."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

import torch_pjrt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))


# Bucketed programs are per-op programs: Strict and Debug (DeferAndFuse compiles graphs).
per_op = pytest.mark.skipif(
    torch.tpu.eager_mode == torch.tpu.EagerMode.DEFER_AND_FUSE,
    reason="DeferAndFuse compiles one program per graph and shape; buckets serve per-op programs",
)


# Every test here runs with shape buckets on (conftest.py).
pytestmark = pytest.mark.usefixtures("shape_buckets")


def reset():
    """Metrics from here on: earlier tests' background compilations finished first."""
    torch_pjrt.wait_background()
    torch_pjrt.reset_metrics()


def _idx(t):
    return torch.arange(t.shape[0], device=t.device).flip(0)


# One op (or a short chain) per case; each runs at sizes 16..21 of dim 0 (one bucket).
CASES = {
    "add_mul": lambda t: (t + 1.5) * t - t / 3,
    "pointwise": lambda t: torch.where(t > 0, t.exp().log1p(), t.sigmoid() * t.tanh()),
    "softmax0": lambda t: t.softmax(0),
    "log_softmax0": lambda t: F.log_softmax(t, 0),
    "sum0": lambda t: t.sum(0),
    "amax_argmax": lambda t: t.amax(0) + t.argmax(0),
    "max_values": lambda t: t.max(0).values,
    "prod": lambda t: t.prod(0),
    "logsumexp": lambda t: t.logsumexp(0),
    "norm": lambda t: t.norm(dim=0),
    "any_all": lambda t: (t > 0).any(0) & (t > -3).all(0),
    "mm": lambda t: t.T @ t,
    "mm_rows": lambda t: t @ t.T,
    "bmm": lambda t: torch.bmm(t.view(1, *t.shape), t.T.reshape(1, *t.T.shape)),
    "cat": lambda t: torch.cat([t, t * 2], 0),
    "index_select": lambda t: t.index_select(0, _idx(t)),
    "embedding": lambda t: F.embedding(torch.arange(t.shape[0], device=t.device) % 8, t[:8]),
    "tril_triu": lambda t: (t @ t.T).tril() - (t @ t.T).triu(1),
    "flip": lambda t: t.flip(0),
    "gelu_silu": lambda t: F.gelu(t) + F.silu(t),
    "transposed_out": lambda t: t.T.contiguous().T * 2,
    "repeat_interleave": lambda t: t.view(1, *t.shape).repeat_interleave(2, 0),
    # Not bucketed (compiled per shape): must still match.
    "mean0": lambda t: t.mean(0),
    "var0": lambda t: t.var(0),
    "sort0": lambda t: t.sort(0).values,
    "cumsum0": lambda t: t.cumsum(0),
    "pad": lambda t: F.pad(t, (0, 0, 1, 2)),
    "cross_entropy": lambda t: F.cross_entropy(
        t, torch.zeros(t.shape[0], dtype=torch.long, device=t.device)
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sizes_of_one_bucket_match_cpu(name):
    f = CASES[name]
    torch.manual_seed(0)
    for n in range(16, 22):
        x = torch.randn(n, 8)
        want = f(x)
        got = f(x.to("tpu")).cpu()
        assert got.shape == want.shape, (name, n)
        torch.testing.assert_close(got.double(), want.double(), atol=1e-4, rtol=1e-4)


@per_op
def test_no_compilation_inside_a_bucket():
    torch.manual_seed(0)
    for n in (40, 33):  # first exact, then the bucket 64's program
        x = torch.randn(n, 8).to("tpu")
        ((x * 2).softmax(0) @ x.T).cpu()
    reset()
    for n in range(34, 64):
        x = torch.randn(n, 8)
        got = ((x.to("tpu") * 2).softmax(0) @ x.to("tpu").T).cpu()
        torch.testing.assert_close(got, (x * 2).softmax(0) @ x.T)
    m = torch_pjrt.metrics()
    # Nothing built (compiled or loaded from the disk cache) inside the bucket.
    assert sum(c[0] for c in m["programs"].values()) == 0, m["programs"]
    assert m["new_shapes_served"] >= 80
    hits = {op: c[2] for op, c in m["programs"].items()}
    assert hits["aten::_softmax"] >= 28 and hits["aten::mm"] >= 28


@per_op
def test_an_index_past_the_real_size_of_a_padded_dim_raises():
    """Duck sizing pads a dim whose size equals a changing one (the indexed dim, 5, once
    there are 5 indices): the range check compares with the real size, not the bucket's."""
    reset()
    for n in (3, 4, 5):
        x = torch.randn(n, 5, device="tpu")
        idx = torch.tensor([1, 9] + [2] * (n - 2), device="tpu")
        with pytest.raises(IndexError, match="index out of range in self"):
            x.index_select(1, idx).cpu()
        torch.tpu.synchronize()  # reported once, by the read
    assert torch_pjrt.metrics()["programs"]["aten::index_select"][1] >= 1  # bucketed


def test_bucketed_sums_over_short_dims_round_like_the_cpu():
    """A padded input keeps its short logical dims, which XLA:CPU would sum in one
    sequential loop (250 x 0.2 gave 50.000118); summed one dim at a time it is as close to
    the float64 sum as the CPU is."""
    reset()
    for n in (9, 10, 11, 12, 13):
        x = torch.full((5, 5, n), 0.2) + torch.rand(5, 5, n) * 1e-3
        want = x.double().sum().item()
        got = x.to("tpu").sum().item()
        cpu = x.sum().item()
        assert abs(got - want) <= max(2 * abs(cpu - want), 4e-6 * abs(want) / 8), (n, got, cpu, want)
    if torch.tpu.eager_mode != torch.tpu.EagerMode.DEFER_AND_FUSE:
        assert torch_pjrt.metrics()["programs"]["aten::sum"][2] > 0  # bucketed calls


@per_op
def test_dims_of_equal_sizes_share_one_size_only_while_equal():
    """Dynamic dims of equal real sizes (attention's [T, T]) share one size parameter, so
    XLA's padder adds no implicit-broadcast selects; a call where they differ must not run
    that program: [20, 20] then [22, 23] in one bucket give the CPU's results."""
    reset()
    torch.manual_seed(2)
    sizes = ((17, 17), (18, 18), (19, 21), (20, 20), (22, 23), (25, 24), (26, 26), (28, 31))
    for n, m in sizes:
        x, y = torch.randn(n, m), torch.randn(n, m)
        got = (x.to("tpu") * 2 + y.to("tpu")).softmax(-1).cpu()
        torch.testing.assert_close(got, (x * 2 + y).softmax(-1), msg=str((n, m)))
    progs = torch_pjrt.metrics()["programs"]
    assert progs["aten::_softmax"][1] >= 2, progs  # [T, T] and [T, U]: two bucketed programs


@per_op
def test_programs_grow_with_buckets_not_sizes():
    reset()
    torch.manual_seed(1)
    for n in range(70, 200, 3):  # buckets 128 and 256
        x = torch.randn(3, n)
        torch.testing.assert_close((x.to("tpu").exp() * 3).sum(1).cpu(), (x.exp() * 3).sum(1))
    progs = torch_pjrt.metrics()["programs"]
    assert progs["aten::sum"][0] <= 3 and progs["aten::exp"][0] <= 3, progs


def test_generation_with_a_growing_cache_matches_cpu():
    from models import Llama

    torch.manual_seed(0)
    m = Llama().eval()
    ids = torch.randint(0, 256, (1, 16))
    want = m.generate(ids, 40)
    mt = Llama().eval()
    mt.load_state_dict(m.state_dict())
    mt = mt.to("tpu")
    reset()
    got = mt.generate(ids.to("tpu"), 40).cpu()
    assert torch.equal(got, want)
    torch_pjrt.wait_background()
    m1 = torch_pjrt.metrics()
    # Another prompt length: bucketed programs serve it.
    ids2 = torch.randint(0, 256, (1, 21))
    reset()
    assert torch.equal(mt.generate(ids2.to("tpu"), 20).cpu(), m.generate(ids2, 20))
    torch_pjrt.wait_background()
    m2 = torch_pjrt.metrics()
    if torch.tpu.eager_mode == torch.tpu.EagerMode.DEFER_AND_FUSE:
        # The ops whose sizes change (the cache's cat, its repeat, attention) run as
        # bucketed per-op programs outside the graph, which flushes before them: the graphs
        # between them keep one structure per phase, so 40 tokens build a few graphs (a
        # dozen at most: before a dim is known to change, the op is in the graph), not one
        # per token, and the other prompt only its prefill's.
        graphs = [m["flush_reasons"].get("dynamic shapes", 0) for m in (m1, m2)]
        assert min(graphs) > 0, graphs
        built = [m["graph_programs"] for m in (m1, m2)]
        assert built[0] <= 12 and built[1] <= 8, built
        return
    assert m2["new_shapes_served"] > 0
    # The decode steps reuse the first call's bucketed programs; prefill at a new length
    # still compiles the ops that were not yet seen changing (#18: not yet "nothing new").
    # Bucketed programs only: the exact-shape programs compiled in the background for
    # shapes served again and again depend on how fast that thread runs.
    built = [sum(c[1] for c in m["programs"].values()) for m in (m1, m2)]
    assert built[1] < built[0], built


@per_op
def test_off_compiles_every_shape():
    torch_pjrt.set_shape_buckets(False)
    reset()
    for n in (101, 102, 103):
        (torch.randn(n, 5).to("tpu") * 7).cpu()
    m = torch_pjrt.metrics()
    assert m["new_shapes_served"] == 0 and m["programs"]["aten::mul"][1] == 0


def test_defer_and_fuse_graph_input_overwritten_by_a_bucketed_op():
    """In DeferAndFuse a bucketed op runs outside the pending graph. When it writes in place
    a tensor the graph reads, ops recorded before see the old value and ops after the new
    one (the graph used to reuse the old value: wrong bias gradients in the GPT's backward,
    where autograd accumulates a gradient in place between reads)."""
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        for n in (17, 18):  # add_'s length becomes dynamic
            a = torch.ones(n, device="tpu")
            a.add_(torch.ones(n, device="tpu"))
            a.cpu()
        reset()
        x, four = torch.ones(20, device="tpu"), torch.full((20,), 4.0, device="tpu")
        torch.tpu.synchronize()
        before = x * 2
        x.add_(four)
        after = x + 1
        assert torch_pjrt.metrics()["programs"]["aten::add"][2] > 0  # served bucketed
    assert before.cpu().tolist() == [2.0] * 20
    assert after.cpu().tolist() == [6.0] * 20


def test_training_over_varying_lengths_matches_cpu():
    from models import GPT

    torch.manual_seed(0)
    cpu = GPT(64, seq_len=64)
    tpu = GPT(64, seq_len=64)
    tpu.load_state_dict(cpu.state_dict())
    tpu = tpu.to("tpu")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (cpu, tpu)]
    gen = torch.Generator().manual_seed(1)
    reset()
    for t in (20, 27, 33, 41, 18, 50, 29, 36):
        x = torch.randint(0, 64, (4, t), generator=gen)
        y = torch.randint(0, 64, (4, t), generator=gen)
        losses = []
        for m, opt, dev in ((cpu, opts[0], "cpu"), (tpu, opts[1], "tpu")):
            opt.zero_grad()
            loss = m.loss(x.to(dev), y.to(dev))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=2e-4, abs=2e-5), (t, losses)
    for p, q in zip(cpu.parameters(), tpu.parameters(), strict=True):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=2e-4, rtol=2e-3)
    if torch.tpu.eager_mode != torch.tpu.EagerMode.DEFER_AND_FUSE:
        assert torch_pjrt.metrics()["new_shapes_served"] > 0



@per_op
def test_a_gradient_read_by_many_calls_of_a_step_is_still_bucketed():
    """A residual stream's gradient is the same storage for every branch's bias: summed by
    four calls in one step, it looked like a parameter (read by many calls: "persistent",
    never staged), so each new length compiled the bias sums exactly. A storage is
    persistent only once read in a later training step than its first."""

    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.branches = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

        def forward(self, x):
            return x + sum(b(x) for b in self.branches)

    torch.manual_seed(0)
    cpu = Branches()
    tpu = Branches()
    tpu.load_state_dict(cpu.state_dict())
    tpu = tpu.to("tpu")
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (cpu, tpu)]
    reset()
    lengths = (17, 19, 21, 23, 25, 27, 29, 31, 18, 20)
    for t in lengths:
        x = torch.randn(4, t, 16)
        for m, opt, dev in ((cpu, opts[0], "cpu"), (tpu, opts[1], "tpu")):
            opt.zero_grad()
            m(x.to(dev)).square().mean().backward()
            opt.step()
    for p, q in zip(cpu.parameters(), tpu.parameters(), strict=True):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=1e-5, rtol=1e-4)
    # Exact programs: the first length's, and the background's for the first four shapes the
    # bucketed program served four times each (each length is summed four times a step),
    # whether or not the background finished them (it did not have to for the bound).
    built, bucketed, served = torch_pjrt.metrics()["programs"]["aten::sum"]
    assert built - bucketed <= 1 + 4 and served >= 4 * (len(lengths) - 3), (built, bucketed,
                                                                          served)


@per_op
def test_padded_results_are_read_in_place_through_views():
    """A bucketed result stays in its padded buffer ([B, T, H, D] with T padded); the next
    bucketed ops read it through views on the device: the tensor whole, a transpose (gathered
    in the buffer's order, then transposed), [B*T, H*D] (B*T runs over the padded T: a digit
    per storage dim), [B, T, H*D] (H and D unpadded: one stride). Values are the CPU's and
    nothing goes through the host once the result is there."""
    torch.manual_seed(0)
    w = torch.randn(24, 8)

    def reads(y):
        b, t = y.shape[:2]
        return [y * 3,
                y.transpose(1, 2).sum(-1),
                y.reshape(b * t, 24) @ w.to(y.device),
                y.reshape(b, t, 24).softmax(-1),
                y.permute(2, 0, 1, 3).sum(0)]

    # Lengths past 16 in one bucket: the second makes T dynamic, the third builds the readers'
    # programs for a padded input, the fourth builds nothing.
    for i, t in enumerate((17, 19, 23, 29)):
        x = torch.randn(2, t, 4, 6)
        y = x.to("tpu") * 2
        torch.tpu.synchronize()
        reset()
        got = reads(y)
        torch.tpu.synchronize()
        m = torch_pjrt.metrics()
        # (Reading the results back compacts them on the host: after the metrics.)
        for g, want in zip(got, reads(x * 2), strict=True):
            torch.testing.assert_close(g.cpu(), want, atol=1e-5, rtol=1e-5)
        if i >= 2:
            assert m["bucket_host_bytes"] == 0, m["bucket_host_bytes"]
        if i == 3:
            assert m["compilations"] == 0, m["programs"]


@per_op
def test_a_fixed_buffer_is_read_in_place_through_a_changing_view():
    """A causal mask's [T, T] corner of a [64, 64] buffer: the buffer's storage is the same
    at every call, so once the signature has seen it a few times its bucketed program reads
    the view from it on the device (before: the corner went through the host every call)."""
    torch.manual_seed(0)
    data = torch.randn(64, 64)
    mask = torch.rand(64, 64) > 0.5
    data_t, mask_t = data.to("tpu"), mask.to("tpu")
    lengths = (17, 19, 21, 23, 25, 27, 29, 31)
    for i, t in enumerate(lengths):
        torch.tpu.synchronize()
        reset()
        got = data_t[:t, :t].masked_fill(mask_t[:t, :t], -1.0)
        torch.tpu.synchronize()
        m = torch_pjrt.metrics()
        torch.testing.assert_close(got.cpu(), data[:t, :t].masked_fill(mask[:t, :t], -1.0))
        if i >= len(lengths) - 2:
            assert m["bucket_host_bytes"] == 0, (t, m["bucket_host_bytes"])
            assert m["compilations"] == 0, (t, m["programs"])


@per_op
def test_a_fixed_size_that_shares_a_bucket_with_a_length_is_not_padded():
    """One mm signature serves a weight gradient ([48, T] @ [T, 16]: 48 output features)
    and a hidden gradient ([T, 8] @ [8, 48]: T rows); with T from 33 to 64, 48 is a size of
    T's bucket at the same dim. Seen in every training step, it counts as fixed there once
    steps are counted: the gradient is computed at its own size, not padded to 64 and
    compacted on the host for the optimizer. Inputs are views of one device tensor (read in
    place), so after the first steps nothing goes through the host."""
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Linear(48, 8))
    tpu = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Linear(48, 8))
    tpu.load_state_dict(cpu.state_dict())
    tpu = tpu.to("tpu")
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (cpu, tpu)]
    data = torch.randn(64, 16)
    data_t = data.to("tpu")
    lengths = (40, 35, 57, 44, 61, 38, 50, 47, 59, 42)
    for i, t in enumerate(lengths):
        torch.tpu.synchronize()
        reset()
        for m, opt, x in ((cpu, opts[0], data), (tpu, opts[1], data_t)):
            opt.zero_grad()
            m(x[:t]).square().mean().backward()
            opt.step()
        torch.tpu.synchronize()
        host = torch_pjrt.metrics()["bucket_host_bytes"]
        if i >= len(lengths) - 3:
            assert host == 0, (t, host)
    for p, q in zip(cpu.parameters(), tpu.parameters(), strict=True):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=1e-5, rtol=1e-4)


def _compile_counters():
    return torch_pjrt.metrics()["compile"]


def test_compiled_dynamic_lengths_run_on_bucketed_ops():
    """torch.compile(dynamic=True): a graph is captured at its first length; other lengths
    run its ATen ops eagerly on bucketed per-op programs (a capture per length compiled a
    whole forward and backward each), with the CPU's results, and lengths inside buckets
    the graph has seen build nothing."""
    from models import GPT

    torch.manual_seed(0)
    cpu = GPT(64, seq_len=64)
    tpu = GPT(64, seq_len=64)
    tpu.load_state_dict(cpu.state_dict())
    tpu = tpu.to("tpu")
    compiled = torch.compile(tpu, backend="tpu", dynamic=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (cpu, tpu)]
    gen = torch.Generator().manual_seed(1)
    reset()

    def step(t):
        x = torch.randint(0, 64, (4, t), generator=gen)
        y = torch.randint(0, 64, (4, t), generator=gen)
        losses = []
        for m, opt, dev in ((cpu, opts[0], "cpu"), (compiled, opts[1], "tpu")):
            opt.zero_grad()
            loss = F.cross_entropy(m(x.to(dev)).flatten(0, 1), y.to(dev).flatten())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=2e-4, abs=2e-5), (t, losses)

    for t in (20, 27, 33, 41, 18, 50, 29, 36):  # buckets 32 and 64, two sizes each
        step(t)
    c = _compile_counters()
    assert c["dynamo_graphs"] == 1 and c["compiled_graphs"] == 2, c  # forward, backward
    assert c["bucketed_graph_calls"] == 2 * 7, c
    reset()
    for t in (22, 45, 25, 38):
        step(t)
    m = torch_pjrt.metrics()
    assert sum(p[0] for p in m["programs"].values()) == 0, m["programs"]
    assert m["compile"].get("compiled_graphs", 0) == 0 and m["new_shapes_served"] > 0, m
    for p, q in zip(cpu.parameters(), tpu.parameters(), strict=True):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=2e-4, rtol=2e-3)


def test_a_recurring_length_of_a_compiled_graph_is_captured():
    """A length that keeps coming back (a last partial batch) gets its own fused program
    after four bucketed calls."""

    def f(x):
        return (x * 2).softmax(-1).sum(0)

    cf = torch.compile(f, backend="tpu", dynamic=True)
    reset()
    for n, calls in ((20, 1), (24, 6)):
        for _ in range(calls):
            x = torch.randn(n, 8)
            torch.testing.assert_close(cf(x.to("tpu")).cpu(), f(x))
    c = _compile_counters()
    assert c["compiled_graphs"] == 2 and c["bucketed_graph_calls"] == 4, c
    assert c["recompilations_new_shape"] == 1, c


def test_compiled_generation_with_a_growing_cache_matches_cpu():
    """A compiled forward (dynamic=True) over a growing cache: the CPU's tokens, one capture
    per Dynamo graph (prefill, decode), not one per token."""
    from models import Llama

    torch.manual_seed(0)
    m = Llama().eval()
    mt = Llama().eval()
    mt.load_state_dict(m.state_dict())
    mt = mt.to("tpu")
    fwd = torch.compile(mt.forward, backend="tpu", dynamic=True)
    ids = torch.randint(0, 256, (1, 16))
    reset()
    with torch.no_grad():
        logits, cache = fwd(ids.to("tpu"))
        out = [ids.to("tpu")]
        for _ in range(24):
            nxt = logits[:, -1:].argmax(-1)
            out.append(nxt)
            logits, cache = fwd(nxt, cache)
    assert torch.equal(torch.cat(out, 1).cpu(), m.generate(ids, 24))
    c = _compile_counters()
    assert c["compiled_graphs"] <= 3 and c["bucketed_graph_calls"] >= 20, c
