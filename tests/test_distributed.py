"""torch.distributed on tpu: the c10d backend, compared with Gloo on CPU tensors and with a
single process. Each test spawns its ranks (world size 2 or 4), in the eager mode the suite
runs in; a rank writes its results to a file the test reads. Tests marked `slow` (world size
4, HSDP, 2-D, checkpoints, two nodes, bfloat16 variants) run in the Strict pass of
scripts/test.sh only; README "Distributed" has the command for all of them in every mode."""

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import assert_close

import torch_pjrt  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))


def _init(rank, world, path, backend=None):
    torch.set_num_threads(1)
    dist.init_process_group(
        backend=backend, init_method=f"file://{path}", rank=rank, world_size=world
    )
    dev = torch.device("tpu", rank % torch.tpu.device_count())
    torch.tpu.set_device(dev)
    return dev


def _run(fn, world, *args):
    """Spawns `world` ranks running fn(rank, world, store_path, out_path, *args); returns
    each rank's JSON result."""
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        mp.spawn(fn, args=(world, store, d, *args), nprocs=world, join=True)
        out = []
        for r in range(world):
            with open(os.path.join(d, f"{r}.json")) as f:
                out.append(json.load(f))
        return out


def _dump(d, rank, obj):
    with open(os.path.join(d, f"{rank}.json"), "w") as f:
        json.dump(obj, f)


# --- collectives against Gloo on CPU tensors ---------------------------------------------

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


def _data(rank, shape, dtype, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-5, 6, shape, generator=g, dtype=dtype)


def _collectives(rank, world, store, d):
    dev = _init(rank, world, store)
    cpu_group = dist.new_group(backend="gloo")
    results = {}

    def both(name, fn):
        """fn(device, group) -> list of tensors; run on tpu (default group) and on CPU
        tensors through Gloo; records whether they agree."""
        if os.environ.get("TORCH_PJRT_DIST_TRACE"):
            print(rank, name, flush=True)
        t = [x.cpu() for x in fn(dev, None)]
        c = fn(torch.device("cpu"), cpu_group)
        ok = all(
            a.shape == b.shape
            and a.dtype == b.dtype
            and torch.allclose(a.double(), b.double(), rtol=1e-2, atol=1e-2)
            for a, b in zip(t, c, strict=True)
        )
        results[name] = ok

    for dname, dt in DTYPES.items():
        ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN]
        if dt != torch.bool:
            ops.append(dist.ReduceOp.PRODUCT)
        if dt in (torch.int64, torch.int32):
            ops += [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR]
        for op in ops:

            def ar(device, group, op=op, dt=dt):
                x = _data(rank, (3, 5), dt).to(device)
                dist.all_reduce(x, op=op, group=group)
                return [x]

            both(f"all_reduce {op} {dname}", ar)

        def bc(device, group, dt=dt):
            x = _data(rank, (4,), dt).to(device)
            dist.broadcast(x, src=world - 1, group=group)
            return [x]

        def ag(device, group, dt=dt):
            outs = [torch.zeros(2, 3, dtype=dt, device=device) for _ in range(world)]
            dist.all_gather(outs, _data(rank, (2, 3), dt).to(device), group=group)
            return outs

        def agt(device, group, dt=dt):
            out = torch.zeros(world * 2, 3, dtype=dt, device=device)
            dist.all_gather_into_tensor(out, _data(rank, (2, 3), dt).to(device), group=group)
            return [out]

        both(f"broadcast {dname}", bc)
        both(f"all_gather {dname}", ag)
        both(f"all_gather_into_tensor {dname}", agt)

    for dname in ("float32", "bfloat16", "int64"):
        dt = DTYPES[dname]

        def rst(device, group, dt=dt):
            out = torch.zeros(3, dtype=dt, device=device)
            dist.reduce_scatter_tensor(out, _data(rank, (world * 3,), dt).to(device), group=group)
            return [out]

        def rs(device, group, dt=dt):
            out = torch.zeros(3, dtype=dt, device=device)
            ins = [_data(rank, (3,), dt, salt=i).to(device) for i in range(world)]
            dist.reduce_scatter(out, ins, group=group) if device.type == "tpu" else None
            if device.type == "cpu":
                # Gloo has no reduce_scatter: the same result from an all_reduce.
                full = torch.stack([_data(rank, (3,), dt, salt=i) for i in range(world)])
                dist.all_reduce(full, group=group)
                out = full[rank].clone()
            return [out]

        def a2a(device, group, dt=dt):
            inp = _data(rank, (world * 2, 2), dt).to(device)
            out = torch.zeros_like(inp)
            dist.all_to_all_single(out, inp, group=group)
            return [out]

        def a2a_uneven(device, group, dt=dt):
            # rank r sends r + 1 rows to each peer
            ins = [r + 1 for r in [rank] * world]
            outs = [p + 1 for p in range(world)]
            inp = _data(rank, (sum(ins), 2), dt).to(device)
            out = torch.zeros(sum(outs), 2, dtype=dt, device=device)
            dist.all_to_all_single(out, inp, outs, ins, group=group)
            return [out]

        def red(device, group, dt=dt):
            x = _data(rank, (4,), dt).to(device)
            dist.reduce(x, dst=0, group=group)
            # Other ranks' tensors: Gloo uses them as scratch; tpu leaves them as they were
            # (as NCCL does).
            return [x] if rank == 0 else []

        def gat(device, group, dt=dt):
            x = _data(rank, (2,), dt).to(device)
            outs = [torch.zeros(2, dtype=dt, device=device) for _ in range(world)] if rank == 0 else None
            dist.gather(x, outs, dst=0, group=group)
            return outs or [x]

        def sca(device, group, dt=dt):
            out = torch.zeros(2, dtype=dt, device=device)
            ins = [_data(9, (2,), dt, salt=i).to(device) for i in range(world)] if rank == 0 else None
            dist.scatter(out, ins, src=0, group=group)
            return [out]

        def noncontig(device, group, dt=dt):
            x = _data(rank, (4, 6), dt).to(device).t()
            dist.all_reduce(x, group=group)
            return [x.contiguous()]

        for name, fn in [("reduce_scatter_tensor", rst), ("reduce_scatter", rs),
                         ("all_to_all_single", a2a), ("all_to_all_single uneven", a2a_uneven),
                         ("reduce", red), ("gather", gat), ("scatter", sca),
                         ("all_reduce non-contiguous", noncontig)]:
            both(f"{name} {dname}", fn)

    def p2p(device, group):
        x = _data(rank, (3,), torch.float32).to(device)
        peer = (rank + 1) % world
        src = (rank - 1) % world
        out = torch.zeros(3, device=device)
        ops = [dist.P2POp(dist.isend, x, peer, group=group), dist.P2POp(dist.irecv, out, src, group=group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return [out]

    if world > 1:  # a rank alone has no peer
        both("batch_isend_irecv", p2p)

    if world > 1:
        # On the CPU plugin Gloo works on the tpu buffers themselves (host memory): no
        # host copies, all_reduce in place; ops queued before still read the old value and
        # a buffer held elsewhere is not written.
        import torch_pjrt

        def copied():
            m = torch_pjrt.metrics()
            return m["host_to_device_bytes"] + m["device_to_host_bytes"]

        x = _data(rank, (64,), torch.float32)
        s = x.clone()
        dist.all_reduce(s, group=cpu_group)
        t = x.to(dev)
        torch.tpu.synchronize()
        where = torch.ops.torch_pjrt.host_alias(t).data_ptr()
        before, n = t * 2, copied()
        dist.all_reduce(t)
        results["all_reduce in the tensor's own buffer"] = (
            torch.ops.torch_pjrt.host_alias(t).data_ptr() == where and copied() == n
        )
        results["ops queued before keep the old value"] = torch.equal(before.cpu(), x * 2)
        results["all_reduce in place"] = torch.allclose(t.cpu(), s)
        t = x.to(dev)
        held = torch.ops.torch_pjrt.host_alias(t)
        dist.all_reduce(t)
        results["a held buffer keeps its value"] = torch.equal(held, x)
        results["all_reduce of a held buffer"] = torch.allclose(t.cpu(), s)
        out, t = torch.empty(64 * world, device=dev), x.to(dev) + 0
        n = copied()
        dist.all_gather_into_tensor(out, t)
        results["all_gather without host copies"] = copied() == n
        g = torch.empty(64 * world)
        dist.all_gather_into_tensor(g, x, group=cpu_group)
        results["all_gather"] = torch.equal(out.cpu(), g)

    # AVG and PREMUL_SUM (Gloo has neither): against SUM on the CPU.
    x = _data(rank, (5,), torch.float32)
    s = x.clone()
    dist.all_reduce(s, group=cpu_group)
    t = x.to(dev)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    results["all_reduce AVG"] = torch.allclose(t.cpu(), s / world, atol=1e-6)
    t = x.to(dev)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.25))
    results["all_reduce PREMUL_SUM"] = torch.allclose(t.cpu(), s * 0.25, atol=1e-6)
    w = dist.all_reduce(x.to(dev), async_op=True)
    # (Work.is_completed() of a Python backend's work stays False: c10d's Python Work
    # forwards only wait() and get_future().)
    results["async Work"] = bool(w.wait()) and w.get_future().done()
    dist.barrier()
    _dump(d, rank, results)
    dist.destroy_process_group()


def test_exit_waits_for_completion_callbacks_still_on_a_gloo_thread():
    """A collective's completion runs on Gloo's thread, which takes the GIL to run and to
    release it; the process must not finalize under it (Python ends such a thread mid-C++:
    "terminate called without an active exception")."""
    import threading
    import time

    from torch_pjrt import distributed as tpu_dist

    ran = []

    def slow(f):
        time.sleep(0.3)
        ran.append(f.value())

    fut = torch.futures.Future()
    tpu_dist._then(fut, slow)
    del slow  # only the future holds it, as with a collective's callback
    t = threading.Thread(target=fut.set_result, args=(7,))
    t.start()
    while not fut.done():
        time.sleep(0.001)
    tpu_dist._drain()
    assert ran == [7]
    t.join()
    assert not tpu_dist._running



@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_collectives_match_gloo_on_cpu(world):
    # World size 1 takes the backend's shortcut (results computed on the device, no Gloo).
    results = _run(_collectives, world)
    for r, res in enumerate(results):
        bad = [k for k, ok in res.items() if not ok]
        assert not bad, f"rank {r}: {bad}"
    assert len(results[0]) >= 74  # every case ran


# --- DDP ------------------------------------------------------------------------------

STEPS, BATCH, SEQ, VOCAB = 20, 4, 16, 64


def _gpt(device):
    import models

    torch.manual_seed(0)
    return models.GPT(VOCAB, d_model=32, n_heads=2, n_layers=1, seq_len=SEQ).to(device)


def _batches(world):
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randint(0, VOCAB, (BATCH * world, SEQ), generator=g),
         torch.randint(0, VOCAB, (BATCH * world, SEQ), generator=g))
        for _ in range(STEPS)
    ]


def _step(net, opt, xs, ys):
    """One training step; returns the loss averaged over the ranks."""
    loss = torch.nn.functional.cross_entropy(net(xs).float().flatten(0, 1), ys.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    rep = loss.detach().clone()
    dist.all_reduce(rep, op=dist.ReduceOp.AVG)
    return rep.item()


def _ddp(rank, world, store, d, hook):
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = _init(rank, world, store)
    model = _gpt(dev)
    ddp = DDP(model)
    if hook == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    losses = []
    for x, y in _batches(world):
        xs = x[rank * BATCH:(rank + 1) * BATCH].to(dev)
        ys = y[rank * BATCH:(rank + 1) * BATCH].to(dev)
        losses.append(_step(ddp, opt, xs, ys))
    _dump(d, rank, {"losses": losses, "w": model.head.weight.detach().cpu().flatten()[:64].tolist()})
    dist.destroy_process_group()


def _single(world):
    dev = torch.device("tpu")
    model = _gpt(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _batches(world):
        out = model(x.to(dev))
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), y.to(dev).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.head.weight.detach().cpu().flatten()[:64].tolist()


def _assert_like_single(results, world, tol=1e-5):
    """Every rank's losses (and head weights when recorded) equal one process's on the
    whole batch."""
    want, w = _single(world)
    for r in results:
        assert_close(torch.tensor(r["losses"]), torch.tensor(want[: len(r["losses"])]),
                     rtol=tol, atol=tol)
        if "w" in r:
            assert_close(torch.tensor(r["w"]), torch.tensor(w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ddp_trains_like_one_process_on_the_whole_batch(world):
    _assert_like_single(_run(_ddp, world, "none"), world)


@pytest.mark.slow
def test_ddp_with_a_bf16_compression_hook():
    results = _run(_ddp, 2, "bf16")
    # bfloat16 gradients: close to the float32 run, not equal.
    _assert_like_single([{"losses": r["losses"]} for r in results], 2, tol=2e-2)
    assert results[0]["losses"] == results[1]["losses"]


# --- torchrun ------------------------------------------------------------------------------


_TORCHRUN_SCRIPT = """
import os, torch, torch_pjrt, torch.distributed as dist
torch.set_num_threads(1)
rank = int(os.environ["LOCAL_RANK"])
forms = ({}, {"backend": "tpu"},
         {"backend": "cpu:gloo,tpu:tpu", "device_id": torch.device("tpu", rank)})
for kwargs in [forms[int(os.environ.get("FORM", "0"))]]:
    dist.init_process_group(**kwargs)
    t = torch.full((3,), float(dist.get_rank() + 1), device="tpu")
    dist.all_reduce(t)
    c = torch.ones(2) * 2
    # CPU tensors need a CPU backend: PyTorch 2.15's default and "tpu" (like "nccl") give
    # only the accelerator's.
    if "cpu:gloo" in kwargs.get("backend", ""):
        dist.all_reduce(c, op=dist.ReduceOp.MAX)  # CPU tensors: Gloo
    # One write per line: the ranks share torchrun's stdout, and print() writes in pieces.
    os.write(1, f"RESULT {dist.get_rank()} {t.device} {t.cpu().tolist()} {c.tolist()}\\n".encode())
    dist.destroy_process_group()
"""


def _torchrun(args, script, env=None):
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args, str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, **(env or {})),
    )


def _results(procs, timeout=300):
    lines = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        lines += [ln for ln in out.splitlines() if ln.startswith("RESULT")]
    return sorted(lines)


@pytest.mark.parametrize(
    "form",
    [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)],
    ids=["no arguments", "tpu", "cpu:gloo,tpu:tpu with device_id"],
)
def test_torchrun_each_rank_uses_its_local_device(tmp_path, form):
    script = tmp_path / "train.py"
    script.write_text(_TORCHRUN_SCRIPT)
    got = _results([_torchrun(["--standalone", "--nproc-per-node", "2"], script,
                              {"FORM": str(form)})])
    assert got == [
        "RESULT 0 tpu:0 [3.0, 3.0, 3.0] [2.0, 2.0]",
        "RESULT 1 tpu:1 [3.0, 3.0, 3.0] [2.0, 2.0]",
    ]


@pytest.mark.slow
def test_torchrun_two_nodes_through_c10d_rendezvous(tmp_path):
    import socket

    script = tmp_path / "train.py"
    script.write_text(_TORCHRUN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "tpu-test"]
    got = _results([_torchrun(args, script), _torchrun(args, script)])
    # One process per node: each is local rank 0, so each uses its tpu:0.
    assert got == [
        "RESULT 0 tpu:0 [3.0, 3.0, 3.0] [2.0, 2.0]",
        "RESULT 1 tpu:0 [3.0, 3.0, 3.0] [2.0, 2.0]",
    ]


_RESTART_SCRIPT = """
import os, signal, sys, torch, torch_pjrt, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
sys.path.insert(0, os.environ["BENCH_DIR"])
import models
torch.set_num_threads(1)
dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device("tpu", int(os.environ["LOCAL_RANK"]))
torch.manual_seed(0)
model = DDP(models.GPT(64, d_model=32, n_heads=2, n_layers=1, seq_len=16).to(dev))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
ckpt, attempt = os.environ["CKPT"], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
start = 0
if os.path.exists(os.path.join(ckpt, ".metadata")):
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    start = int(state["step"]) + 1
for step in range(start, 10):
    if attempt == 0 and rank == 1 and step == int(os.environ.get("KILL_AT", "-1")):
        os.kill(os.getpid(), signal.SIGKILL)  # the node dies mid-run: no cleanup
    g = torch.Generator().manual_seed(step)
    x, y = (torch.randint(0, 64, (4 * world, 16), generator=g) for _ in range(2))
    x, y = x[rank * 4:(rank + 1) * 4].to(dev), y[rank * 4:(rank + 1) * 4].to(dev)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    rep = loss.detach().clone()
    dist.all_reduce(rep, op=dist.ReduceOp.AVG)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": torch.tensor(step)}, checkpoint_id=ckpt)
    if rank == 0:
        os.write(1, f"RESULT {attempt} {step} {rep.item()!r}\\n".encode())
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_torchrun_restarts_a_killed_run_from_its_checkpoint(tmp_path):
    # One rank is killed at step 6 of its first attempt; torchrun (--max-restarts 1) stops
    # the other and starts both again; they resume from the step-5 checkpoint (DCP) and
    # train to the uninterrupted run's losses.
    script = tmp_path / "train.py"
    script.write_text(_RESTART_SCRIPT)
    bench = os.path.join(HERE, "..", "bench")

    def losses(name, kill_at):
        args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
        env = {"BENCH_DIR": bench, "CKPT": str(tmp_path / name), "KILL_AT": str(kill_at)}
        return [ln.split()[1:] for ln in _results([_torchrun(args, script, env)], timeout=600)]

    whole = {int(s): float(v) for a, s, v in losses("whole", -1)}
    killed = losses("killed", 6)
    assert sorted(whole) == list(range(10))
    # The first attempt ends with step 5 (step 6 needs rank 1's gradients); the second
    # resumes after it.
    first = [int(s) for a, s, _ in killed if a == "0"]
    second = [int(s) for a, s, _ in killed if a == "1"]
    assert first == list(range(6)) and second == list(range(6, 10)), killed
    for _, s, v in killed:
        assert abs(float(v) - whole[int(s)]) <= 1e-5 * abs(whole[int(s)]), (s, v, whole[int(s)])


# --- FSDP2, DTensor, tensor parallelism, checkpoints -------------------------------------


def _train_sharded(rank, world, store, d, kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dev = _init(rank, world, store)
    model = _gpt(dev)
    dp_rank, dp_size = rank, world
    if kind in ("fsdp", "fsdp_bf16", "fsdp_keep"):
        mesh = init_device_mesh("tpu", (world,))
        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if kind == "fsdp_bf16" else None
        )
        for b in model.blocks:
            fully_shard(b, mesh=mesh, mp_policy=mp_policy,
                        reshard_after_forward=kind != "fsdp_keep")
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    elif kind == "hsdp":
        mesh = init_device_mesh("tpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "tp":
        # Every rank sees the whole batch; the MLPs are split across ranks.
        mesh = init_device_mesh("tpu", (world,))
        for b in model.blocks:
            parallelize_module(b, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        dp_rank, dp_size = 0, 1
    elif kind == "fsdp_tp":
        mesh = init_device_mesh("tpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp_rank, dp_size = mesh.get_local_rank("dp"), 2
    # TP alone leaves plain tensors next to DTensors: PyTorch's foreach kernels refuse the mix.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=kind != "tp")
    losses = []
    n = BATCH * world // dp_size
    for x, y in _batches(world):
        xs = x[dp_rank * n:(dp_rank + 1) * n].to(dev)
        ys = y[dp_rank * n:(dp_rank + 1) * n].to(dev)
        losses.append(_step(model, opt, xs, ys))
    w = model.head.weight
    if isinstance(w, DTensor):
        w = w.full_tensor()
    _dump(d, rank, {"losses": losses, "w": w.detach().cpu().flatten()[:64].tolist()})
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "kind,world",
    [("fsdp", 2), pytest.param("fsdp_keep", 2, marks=pytest.mark.slow),
     pytest.param("hsdp", 4, marks=pytest.mark.slow), ("tp", 2),
     pytest.param("fsdp_tp", 4, marks=pytest.mark.slow)],
)
def test_sharded_training_matches_one_process(kind, world):
    _assert_like_single(_run(_train_sharded, world, kind), world)


@pytest.mark.slow
def test_fsdp2_bfloat16_parameters():
    results = _run(_train_sharded, 2, "fsdp_bf16")
    _assert_like_single([{"losses": r["losses"]} for r in results], 2, tol=3e-2)


def _dtensor_ops(rank, world, store, d):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    _init(rank, world, store)
    mesh = init_device_mesh("tpu", (world,))
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    res = {}
    s = distribute_tensor(full.to("tpu"), mesh, [Shard(0)])
    res["local shard"] = s.to_local().cpu().tolist() == full[rank * 2:(rank + 1) * 2].tolist()
    r = s.redistribute(mesh, [Replicate()])
    res["replicate"] = r.to_local().cpu().tolist() == full.tolist()
    s1 = r.redistribute(mesh, [Shard(1)])
    res["shard 1"] = s1.to_local().cpu().tolist() == full[:, rank * 3:(rank + 1) * 3].tolist()
    # Each rank holds a part of a sum: Partial -> Replicate is an all_reduce, -> Shard a
    # reduce_scatter.
    part = DTensor.from_local((full * (rank + 1)).to("tpu"), mesh, [Partial()])
    total = full * sum(range(1, world + 1))
    res["partial"] = part.full_tensor().cpu().tolist() == total.tolist()
    sh = part.redistribute(mesh, [Shard(0)]).to_local().cpu()
    res["partial to shard"] = sh.tolist() == total[rank * 2:(rank + 1) * 2].tolist()
    mm = (s @ distribute_tensor(full.t().contiguous().to("tpu"), mesh, [Replicate()]))
    res["matmul"] = torch.allclose(mm.full_tensor().cpu(), full @ full.t())
    _dump(d, rank, res)
    dist.destroy_process_group()


def test_dtensor_placements_and_redistribution():
    for r, res in enumerate(_run(_dtensor_ops, 2)):
        assert all(res.values()), (r, res)


def _checkpoint(rank, world, store, d, phase):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dev = _init(rank, world, store)
    mesh = init_device_mesh("tpu", (world,))
    model = _gpt(dev)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = os.path.join(os.path.dirname(store), "..", "ckpt")
    batches = _batches(world)
    start = 0
    if phase == "resume":
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = 5
    losses = []
    for i in range(start, 10):
        x, y = batches[i]
        xs, ys = x[rank * BATCH:(rank + 1) * BATCH].to(dev), y[rank * BATCH:(rank + 1) * BATCH].to(dev)
        losses.append(_step(model, opt, xs, ys))
        if phase == "save" and i == 4:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    _dump(d, rank, {"losses": losses})
    dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_checkpoint_resumes_the_same_losses(tmp_path):
    whole = _run(_checkpoint, 2, "save")
    resumed = _run(_checkpoint, 2, "resume")
    assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(whole[0]["losses"][5:]),
                 rtol=1e-5, atol=1e-6)


# --- MPMD: ranks that run different programs between collectives --------------------------


def _mpmd(rank, world, store, d, diverge):
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = _init(rank, world, store)
    model = _gpt(dev)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    losses, evals = [], []
    held_out = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    for i, (x, y) in enumerate(_batches(world)[:8]):
        xs = x[rank * BATCH:(rank + 1) * BATCH].to(dev)
        ys = y[rank * BATCH:(rank + 1) * BATCH].to(dev)
        loss = torch.nn.functional.cross_entropy(ddp(xs).flatten(0, 1), ys.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if diverge and rank == 0 and i % 3 == 0:
            # Rank 0 alone: evaluation, host reads and a checkpoint, other ops entirely.
            with torch.no_grad():
                logits = model(held_out.to(dev))
                evals.append(logits.float().softmax(-1).max().item())
            torch.save({k: v.cpu() for k, v in model.state_dict().items()},
                       os.path.join(d, "mpmd.pt"))
        elif diverge and rank == 1:
            _ = (torch.randn(16, 16, device=dev) @ torch.randn(16, 16, device=dev)).sum().item()
        rep = loss.detach().clone()
        dist.all_reduce(rep, op=dist.ReduceOp.AVG)
        losses.append(rep.item())
    _dump(d, rank, {"losses": losses, "evals": evals})
    dist.destroy_process_group()


def test_mpmd_ranks_diverge_between_collectives():
    same = _run(_mpmd, 2, False)
    diverged = _run(_mpmd, 2, True)
    assert len(diverged[0]["evals"]) == 3 and not diverged[1]["evals"]
    for r in range(2):
        if torch.tpu.eager_mode == torch.tpu.EagerMode.DEFER_AND_FUSE:
            # Rank 0's reads cut its deferred graphs elsewhere: the optimizer step is fused
            # with other ops, and XLA's code for another graph may round differently (1e-7
            # seen once in CI). Per-op programs (Strict, Debug) give the very same bits.
            assert_close(torch.tensor(diverged[r]["losses"]), torch.tensor(same[r]["losses"]),
                         rtol=1e-6, atol=0)
        else:
            assert diverged[r]["losses"] == same[r]["losses"]


# --- faults ----------------------------------------------------------------------------------


def _fault(rank, world, store, d, kind):
    import datetime

    torch.set_num_threads(1)
    dist.init_process_group(init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    dev = torch.device("tpu", rank)
    torch.tpu.set_device(dev)
    dist.barrier()
    import time

    t0 = time.monotonic()
    err = None
    try:
        if kind == "shape":
            dist.all_reduce(torch.ones(3 + rank, device=dev))
        elif kind == "dtype":
            dist.all_reduce(torch.ones(3, device=dev, dtype=torch.float32 if rank else torch.int32))
        elif kind == "device":
            dist.all_reduce(torch.ones(3))  # a CPU tensor on the tpu backend alone
        elif kind == "killed":
            if rank == 1:
                os._exit(3)
            dist.all_reduce(torch.ones(3, device=dev))
        torch.tpu.synchronize()
    except Exception as e:  # what a user catches
        err = f"{type(e).__name__}: {e}"
    _dump(d, rank, {"error": err, "seconds": time.monotonic() - t0})
    os._exit(0)


@pytest.mark.parametrize("kind", ["shape", pytest.param("dtype", marks=pytest.mark.slow), "device"])
def test_mismatched_collectives_raise_within_the_timeout(kind):
    for r, res in enumerate(_run(_fault, 2, kind)):
        assert res["error"], f"rank {r} did not raise"
        assert res["seconds"] < 120, res
        if kind == "device":
            assert "No backend type associated with device type cpu" in res["error"]
        else:
            assert "all_reduce: the ranks' calls do not match" in res["error"], res


def test_a_killed_rank_makes_the_others_raise():
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_fault, args=(r, 2, store, d, "killed")) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert procs[1].exitcode == 3
        with open(os.path.join(d, "0.json")) as f:
            res = json.load(f)
    assert res["error"] and res["seconds"] < 120, res


# --- torch.compile ---------------------------------------------------------------------------


def _compiled(rank, world, store, d):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torch_pjrt import compile as tc

    dev = _init(rank, world, store)
    torch._dynamo.reset()

    @torch.compile(backend="tpu")
    def f(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    outs = [f(torch.full((4,), float(rank + i), device=dev)).cpu().tolist() for i in range(3)]
    split = dict(tc.counters)
    model = _gpt(dev)
    ddp = torch.compile(DDP(model), backend="tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _batches(world)[:5]:
        xs = x[rank * BATCH:(rank + 1) * BATCH].to(dev)
        ys = y[rank * BATCH:(rank + 1) * BATCH].to(dev)
        losses.append(_step(ddp, opt, xs, ys))
    _dump(d, rank, {"outs": outs, "split": split, "losses": losses,
                    "breaks": sum(torch._dynamo.utils.counters["graph_break"].values())})
    dist.destroy_process_group()


def test_compiled_graphs_run_collectives_between_their_pieces():
    results = _run(_compiled, 2)
    _assert_like_single([{"losses": r["losses"]} for r in results], 2)
    for r in results:
        assert r["outs"] == [[2.0 * (2 * i + 1) + 1] * 4 for i in range(3)], r["outs"]
        assert r["split"]["graphs_split_at_collectives"] == 1
        assert r["split"]["compiled_graphs"] == 2 and r["split"]["collectives"] == 6
        assert r["split"].get("graph_breaks", 0) == 0
