"""Device memory: torch.tpu.memory_* / torch.accelerator.memory_* counts, limits and
out-of-memory errors, in every eager mode.

Counts are the bytes of live tpu storages; the tests check them against the sizes of the
tensors they create and free. Running out of memory (past the machine, or past a set
fraction) raises torch.OutOfMemoryError, leaves every tensor intact, and training goes on.
"""

import gc

import pytest
import torch
import torch.nn as nn


@pytest.fixture(autouse=True)
def _no_limit():
    yield
    torch.tpu.set_per_process_memory_fraction(1.0)


def allocated():
    gc.collect()
    return torch.tpu.memory_allocated()


def nbytes(*ts):
    seen = {}
    for t in ts:
        s = t.untyped_storage()
        seen[s.data_ptr(), s.device] = s.nbytes()
    return sum(seen.values())


def test_counts_follow_tensors(eager_mode):
    base = allocated()
    a = torch.ones(1000, device="tpu")
    b = torch.zeros(250, 4, dtype=torch.float64, device="tpu")
    assert allocated() - base == 4000 + 8000
    c = a * 2 + 1  # in DeferAndFuse, a lazy storage: counted from the op on
    v = a[10:20]  # a view shares its storage
    assert allocated() - base == nbytes(a, b, c, v) == 16000
    a.add_(1)  # in place: same storage
    assert allocated() - base == 16000
    del a, v
    assert allocated() - base == 12000
    assert c.sum().item() == 3000
    del b, c
    assert allocated() == base


def test_peak_and_reset(eager_mode):
    torch.tpu.reset_peak_memory_stats()
    base = allocated()
    x = torch.empty(1 << 20, device="tpu")
    del x
    assert torch.tpu.max_memory_allocated() - base >= 4 << 20
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == allocated()


def test_training_state_is_counted_exactly(eager_mode):
    torch.manual_seed(0)
    base = allocated()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # donates its state buffers
    x, y = torch.randn(16, 64, device="tpu"), torch.randn(16, 8, device="tpu")
    for _ in range(3):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    loss.item()
    live = [*model.parameters(), *(p.grad for p in model.parameters()), x, y, loss]
    live += [t for st in opt.state.values() for t in st.values() if t.device.type == "tpu"]
    assert allocated() - base == nbytes(*live)


def test_accelerator_api_agrees():
    a = torch.ones(100, device="tpu")
    assert torch.accelerator.memory_allocated(0) == torch.tpu.memory_allocated(0)
    assert torch.accelerator.memory_stats(0) == torch.tpu.memory_stats(0)
    assert torch.tpu.memory_reserved() >= torch.tpu.memory_allocated() >= a.nbytes
    free, total = torch.tpu.mem_get_info()
    assert 0 < free <= total
    assert "Allocated memory" in torch.tpu.memory_summary()
    torch.tpu.empty_cache()
    assert a.sum().item() == 100


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _train(model, opt, batches, device):
    losses = []
    for x, y in batches:
        x = x.to(device)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _models():
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    tpu = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to("tpu")
    tpu.load_state_dict(cpu.state_dict())
    return cpu, tpu


OVERSIZED = {
    "factory": lambda: torch.empty(1 << 34, device="tpu").fill_(1.0),
    "op output": lambda: torch.ones(1, device="tpu").expand(1 << 34) + 1,
    "cpu copy": lambda: torch.zeros(1, dtype=torch.uint8).expand(1 << 36).to("tpu"),
}


@pytest.mark.parametrize("how", list(OVERSIZED))
def test_more_than_the_machine_raises_and_training_goes_on(how, eager_mode):
    cpu, tpu = _models()
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
    opt_t = torch.optim.SGD(tpu.parameters(), lr=0.1, momentum=0.9)
    data = _batches(6)
    want = _train(cpu, opt_c, data, "cpu")
    got = _train(tpu, opt_t, data[:3], "tpu")
    keep = torch.arange(10.0, device="tpu")
    before = allocated()
    ooms = torch.tpu.memory_stats().get("num_ooms", 0)
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 64\.00 GiB on tpu:0"):
        OVERSIZED[how]()
        torch.tpu.synchronize()
    assert torch.tpu.memory_stats()["num_ooms"] == ooms + 1
    assert allocated() == before
    assert keep.sum().item() == 45.0
    got += _train(tpu, opt_t, data[3:], "tpu")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)


def test_fraction_limits_and_can_be_raised(eager_mode):
    keep = torch.ones(1 << 16, device="tpu")
    torch.tpu.set_per_process_memory_fraction(0.0)
    with pytest.raises(torch.OutOfMemoryError, match="set_per_process_memory_fraction"):
        torch.ones(10, device="tpu")
    with pytest.raises(torch.OutOfMemoryError):
        keep * 2
    torch.tpu.set_per_process_memory_fraction(1.0)
    assert (keep * 2).sum().item() == 2 << 16


def test_fraction_argument_errors():
    with pytest.raises(TypeError, match="must be `float`"):
        torch.tpu.set_per_process_memory_fraction(1)
    with pytest.raises(ValueError, match=r"Invalid fraction value: 1.5. Allowed range: 0~1"):
        torch.tpu.set_per_process_memory_fraction(1.5)
    with pytest.raises(ValueError, match="Invalid device index"):
        torch.tpu.memory_allocated(99)


def test_compiled_graphs_are_counted_and_refused_like_eager():
    torch._dynamo.reset()

    def step(x):
        return (x * 2).sum(0), x + 1

    f = torch.compile(step, backend="tpu")
    x = torch.randn(64, 32, device="tpu")
    base = allocated()
    for _ in range(3):  # capture, then replays
        a, b = f(x)
    assert allocated() - base == nbytes(a, b)
    del a, b
    assert allocated() == base

    huge = torch.compile(lambda t: t.expand(1 << 34) + 1, backend="tpu")
    one = torch.ones(1, device="tpu")
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 64\.00 GiB"):
        huge(one)
        torch.tpu.synchronize()
    assert f(x)[1].sum().item() == pytest.approx((x + 1).sum().item(), rel=1e-5)
