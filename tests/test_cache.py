"""The persistent compilation cache: reuse across processes, bad entries, unwritable
directories, concurrent writers, key contents, the Python API.

Most tests run the same small training (MLP, SGD, 3 steps per-op, then 3 steps in
DeferAndFuse mode) in fresh processes sharing a TORCH_TPU_CACHE_DIR under tmp_path.
The cache the test process itself uses is left alone, except by the tests that point it
at a temporary directory with set_cache_dir (and restore it).
"""

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

import torch_pjrt

WORKER = r"""
import json, warnings
import torch, torch_pjrt
import torch.nn.functional as F

def train(dev):
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=g).to(dev)
    y = torch.randint(0, 4, (8,), generator=g).to(dev)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    losses = train("tpu")
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        losses += train("tpu")
print(json.dumps({
    "losses": losses,
    "info": torch_pjrt.cache_info(),
    "warnings": [str(w.message) for w in caught if "cache" in str(w.message)],
}))
"""

CORRUPT_WARNING = "unusable compilation cache entry"
UNWRITABLE_WARNING = "cannot write the compilation cache"


def _env(cache_dir, **extra):
    # One entry per program: the quick tier (a quick and, once hot, an optimized entry per
    # program, written by a background thread) is tested on its own below.
    env = {"TORCH_TPU_QUICK_COMPILE": "0", **extra}
    return {**os.environ, "TORCH_TPU_CACHE_DIR": str(cache_dir), **env}


def _start(cache_dir, **extra):
    return subprocess.Popen(
        [sys.executable, "-c", WORKER], env=_env(cache_dir, **extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _result(p):
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _run(cache_dir, **extra):
    return _result(_start(cache_dir, **extra))


def _entries(d):
    return sorted(p for p in d.iterdir() if p.suffix == ".pjrt")


@pytest.fixture(scope="module")
def reference():
    """The CPU losses of the worker's training."""
    ns = {}
    exec(WORKER.split("with warnings")[0], ns)
    cpu = ns["train"]("cpu")
    return cpu + cpu


def _well_formed(p):
    """An entry: magic, format, key (= file name), payload length, payload, SHA-256."""
    data = p.read_bytes()
    n = int.from_bytes(data[44:52], "little")
    return (
        data[:8] == b"TPJRTEXE"
        and data[12:44].hex() == p.stem
        and len(data) == 52 + n + 32
        and hashlib.sha256(data[:-32]).digest() == data[-32:]
    )


@pytest.fixture(scope="module")
def populated(tmp_path_factory):
    """A cache directory filled by two processes running at once (both compile the same
    programs and write the same keys concurrently), and their results."""
    d = tmp_path_factory.mktemp("populated")
    procs = [_start(d), _start(d)]
    return d, [_result(p) for p in procs]


def _check_losses(r, reference):
    torch.testing.assert_close(r["losses"], reference, rtol=1e-4, atol=1e-6)


def test_concurrent_cold_runs_store_every_program(populated, reference):
    d, runs = populated
    entries = _entries(d)
    for r in runs:
        info = r["info"]
        _check_losses(r, reference)
        assert r["losses"] == runs[0]["losses"]
        assert info["directory"] == str(d) and not r["warnings"]
        # Every program is looked up once; what the other process had not stored yet is
        # compiled here (which process compiles what depends on timing).
        assert info["disk_misses"] == info["compilations"]
        assert info["disk_hits"] + info["disk_misses"] == len(entries)
        assert info["corrupt_entries"] == 0
    assert sum(r["info"]["compilations"] for r in runs) >= len(entries)
    # Whole entries only, no temp files left behind.
    assert all(p.suffix == ".pjrt" for p in d.iterdir())
    assert all(_well_formed(p) for p in entries)


def test_second_process_compiles_nothing(populated):
    d, runs = populated
    warm = _run(d)
    info = warm["info"]
    assert info["compilations"] == 0, info
    assert info["disk_hits"] == len(_entries(d)) and info["disk_misses"] == 0
    assert info["load_seconds"] > 0 and info["compile_seconds"] == 0
    assert warm["losses"] == runs[0]["losses"]
    assert not warm["warnings"]


def test_quick_and_optimized_programs_are_cached(tmp_path):
    cold = _run(tmp_path, TORCH_TPU_QUICK_COMPILE="1")
    warm = _run(tmp_path, TORCH_TPU_QUICK_COMPILE="1")
    assert cold["info"]["compilations"] > 0
    # Quick entries, and optimized ones for the programs that became hot in time.
    assert len(_entries(tmp_path)) >= cold["info"]["compilations"]
    assert warm["info"]["compilations"] == 0 and warm["info"]["disk_hits"] > 0
    torch.testing.assert_close(warm["losses"], cold["losses"], rtol=1e-5, atol=1e-6)


def test_bad_entries_warn_once_and_are_recompiled(populated, tmp_path):
    src, runs = populated
    d = tmp_path / "cache"
    shutil.copytree(src, d)
    rng = random.Random(0)
    entries = _entries(d)
    truncated, scrambled = entries[0::3], entries[1::3]
    for p in truncated:
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    for p in scrambled:
        p.write_bytes(bytes(rng.randrange(256) for _ in range(p.stat().st_size)))
    bad = len(truncated) + len(scrambled)
    r = _run(d)
    info = r["info"]
    assert r["losses"] == runs[0]["losses"]
    assert len(r["warnings"]) == 1 and CORRUPT_WARNING in r["warnings"][0], r["warnings"]
    assert info["corrupt_entries"] == bad
    assert info["compilations"] == bad and info["disk_hits"] == len(entries) - bad
    # The bad entries were overwritten with good ones.
    assert _entries(d) == entries and all(_well_formed(p) for p in entries)


def test_unwritable_directory_warns_once_and_caches_in_memory(tmp_path, reference):
    # Tests run as root, where a chmod 0o555 directory is still writable; a directory
    # under a regular file can be created by nobody (ENOTDIR), root included.
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    r = _run(blocker / "sub")
    info = r["info"]
    _check_losses(r, reference)
    assert len(r["warnings"]) == 1 and UNWRITABLE_WARNING in r["warnings"][0], r["warnings"]
    assert info["entries"] == 0 and not info["writable"]
    # The in-memory caches still work: each program compiled once.
    assert info["compilations"] == info["disk_misses"] > 0 and info["memory_hits"] > 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into chmod 0o555 directories")
def test_read_only_directory_serves_hits(populated, tmp_path):
    src, (cold, _) = populated
    d = tmp_path / "cache"
    shutil.copytree(src, d)
    (_entries(d)[0]).unlink()
    d.chmod(0o555)
    try:
        r = _run(d)
    finally:
        d.chmod(0o755)
    assert r["losses"] == cold["losses"]
    assert r["info"]["compilations"] == 1 and len(r["warnings"]) == 1


def test_size_cap_evicts(tmp_path, reference):
    cap = 80_000
    # Strict compiles one program per op: enough entries to overflow the cap.
    r = _run(tmp_path, TORCH_TPU_CACHE_MAX_BYTES=str(cap), TORCH_TPU_DEFER_AND_FUSE="0")
    _check_losses(r, reference)
    assert r["info"]["max_bytes"] == cap
    assert 0 < r["info"]["bytes"] <= cap and r["info"]["entries"] < r["info"]["compilations"]


@pytest.fixture
def cache_dir(tmp_path):
    """Points this process's disk cache at an empty directory; restores it afterwards."""
    old = torch_pjrt.cache_info()["directory"]
    torch_pjrt.clear_cache(disk=False)
    torch_pjrt.set_cache_dir(tmp_path)
    yield tmp_path
    torch_pjrt.set_cache_dir(old)


def _add(device, n=5):
    a = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    return (a.to(device) * 3 + 1).cpu()


def test_key_depends_on_device_and_api(cache_dir):
    if torch.tpu.device_count() < 2:
        pytest.skip("needs two devices")
    expected = _add("cpu", 7)
    torch_pjrt.reset_metrics()
    torch.testing.assert_close(_add("tpu:0", 7), expected)
    n0 = torch_pjrt.cache_info()
    assert n0["entries"] == n0["compilations"] > 0
    torch.testing.assert_close(_add("tpu:1", 7), expected)
    n1 = torch_pjrt.cache_info()
    # Same programs, other device: other compile options, other keys.
    assert n1["entries"] == 2 * n0["entries"] and n1["compilations"] == 2 * n0["compilations"]
    torch_pjrt.clear_cache(disk=False)
    torch.testing.assert_close(_add("tpu:1", 7), expected)
    n2 = torch_pjrt.cache_info()
    assert n2["compilations"] == n1["compilations"] and n2["disk_hits"] == n0["compilations"]
    assert torch_pjrt.clear_cache(disk=True) == n1["entries"]
    assert torch_pjrt.cache_info()["entries"] == 0 and not _entries(cache_dir)


def test_turned_off(cache_dir):
    torch_pjrt.set_cache_dir(None)
    info = torch_pjrt.cache_info()
    assert info["directory"] is None and info["entries"] == 0
    torch_pjrt.reset_metrics()
    torch.testing.assert_close(_add("tpu", 9), _add("cpu", 9))
    info = torch_pjrt.cache_info()
    assert info["compilations"] > 0 and info["disk_misses"] == 0 and info["disk_hits"] == 0
    assert not list(cache_dir.iterdir())


BOUNDED = r"""
import json, torch, torch_pjrt
def run(n):
    x = torch.arange(float(n))
    return (x.to("tpu") * 3 + n).sum().item(), (x * 3 + n).sum().item()
first = [run(n) for n in range(1, 41)]        # 40 shapes, several programs each
m = torch_pjrt.metrics()
again = [run(n) for n in range(1, 6)]          # the earliest shapes were evicted
m2 = torch_pjrt.metrics()
print(json.dumps({"ok": all(a == b for a, b in first + again), "cached": m["cached_programs"],
                  "evicted": m["evicted_programs"], "compilations": m2["compilations"] - m["compilations"],
                  "disk_hits": m2["disk_hits"] - m["disk_hits"]}))
"""


def test_memory_cache_is_bounded(cache_dir):
    """Loaded executables are bounded (XLA:CPU fails past some 12 000 in a process):
    beyond TORCH_TPU_MAX_CACHED_PROGRAMS the least recently used are dropped, and coming
    back to them loads them from the disk cache instead of compiling."""
    # One exact program per shape (shape buckets would serve the 40 sizes with a few).
    env = _env(cache_dir, TORCH_TPU_MAX_CACHED_PROGRAMS="16", TORCH_TPU_SHAPE_BUCKETS="0")
    env.pop("TORCH_TPU_DEFER_AND_FUSE", None)  # per-op programs: Strict (the suite may run DF)
    p = subprocess.run([sys.executable, "-c", BOUNDED], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["ok"], r
    assert r["cached"] <= 16 and r["evicted"] > 40, r
    assert r["compilations"] == 0 and r["disk_hits"] > 0, r
