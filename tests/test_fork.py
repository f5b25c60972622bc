"""Processes made after the parent set up the tpu device.

A child forked after `import torch_pjrt` inherits the PJRT client but none of its threads:
like CUDA, a tpu op there raises at once (RuntimeError, "Cannot re-initialize tpu in forked
subprocess ... 'spawn' start method") instead of hanging, `torch.tpu._is_in_bad_fork()`
says so, and CPU work goes on (DataLoader workers). A spawned child uses tpu normally.
Each scenario runs in a fresh interpreter with a time limit, so a hang fails the test.
"""

import subprocess
import sys
import tempfile
import textwrap

PARENT = """
import multiprocessing as mp, sys, torch, torch_pjrt
x = torch.ones(3, device="tpu") + 1          # the parent uses the device
assert x.sum().item() == 6.0
assert not torch.tpu._is_in_bad_fork()
"""


def run(code, timeout=120):
    """Runs PARENT + code as a script file (spawned children re-import it)."""
    with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write(textwrap.dedent(PARENT + code))
        f.flush()
        out = subprocess.run([sys.executable, f.name], capture_output=True, text=True,
                             timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_forked_child_raises_at_its_first_tpu_op():
    out = run("""
def child(q):
    try:
        q.put(("bad fork", torch.tpu._is_in_bad_fork()))
        q.put(("cpu", (torch.ones(3) * 2).sum().item()))
        q.put(("count", torch.tpu.device_count()))
        for what, f in (("ones", lambda: torch.ones(3, device="tpu")),
                        ("add", lambda: (x + 1).cpu()),
                        ("item", lambda: x.sum().item())):
            try:
                f()
                q.put((what, "no error"))
            except RuntimeError as e:
                q.put((what, str(e)))
    finally:
        q.put(None)

ctx = mp.get_context("fork")
q = ctx.Queue()
p = ctx.Process(target=child, args=(q,))
p.start()
got = dict(iter(lambda: q.get(timeout=60), None))
p.join(60)
print(got)
assert got["bad fork"] is True and got["cpu"] == 6.0
assert got["count"] == torch.tpu.device_count()
for what in ("ones", "add", "item"):
    assert "Cannot re-initialize tpu in forked subprocess" in got[what], (what, got[what])
    assert "'spawn' start method" in got[what]
assert p.exitcode == 0
assert (x * 2).sum().item() == 12.0           # the parent goes on
print("OK")
""")
    assert "OK" in out


def test_dataloader_fork_workers_make_cpu_batches():
    """Workers that only build CPU tensors keep working; the parent moves batches to tpu."""
    out = run("""
from torch.utils.data import DataLoader, Dataset

class Squares(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return torch.full((2,), float(i)) ** 2

dl = DataLoader(Squares(), batch_size=4, num_workers=2, multiprocessing_context="fork")
total = sum((b.to("tpu") + 0).sum().item() for b in dl)
assert total == 2 * sum(i * i for i in range(8)), total
print("OK")
""")
    assert "OK" in out


def test_spawned_child_uses_tpu():
    out = run("""
def child(q):
    import torch, torch_pjrt
    q.put(((torch.arange(4.0, device="tpu") * 2).sum().item(), torch.tpu._is_in_bad_fork()))

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(q.get(timeout=100))
    p.join(60)
    assert p.exitcode == 0
""", timeout=180)
    assert "(12.0, False)" in out
