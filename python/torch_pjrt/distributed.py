"""The ``tpu`` c10d backend: torch.distributed's collectives on tpu tensors.

Registered at import as backend ``"tpu"`` for device type ``tpu`` and made the device's
default, so ``dist.init_process_group()`` under ``torchrun`` (or ``"tpu"``, or
``"cpu:gloo,tpu:tpu"``) gives tpu tensors a backend. PyTorch's own stack does the rest
(store, rendezvous, DDP, FSDP2, DTensor, functional collectives).

Transport on the XLA CPU plugin, which has no cross-process collectives: each collective
hands its tpu inputs to Gloo (PyTorch's) as host tensors (waiting for the ops that produce
them, flushing DeferAndFuse's pending graph) and makes Gloo's results the tpu outputs'
values. The plugin's buffers are host memory, so no copy is made where none is needed: an
input Gloo only reads is the buffer itself (``torch_pjrt::host_alias``), an all_reduce
writes into its tensor's buffer in place when nothing else holds that buffer, and a result
Gloo wrote elsewhere becomes a whole dense output's buffer (``torch_pjrt::adopt_host``).
Otherwise (other plugins, views, bool, a shared buffer) through host copies. AVG and
PREMUL_SUM, which Gloo refuses, are a SUM scaled on the host; bool travels as uint8. The
call returns once Gloo has the data; the exchange runs on Gloo's threads and its completion
(a callback on Gloo's future) gives the tpu tensors their results, so ``async_op=True``
overlaps communication with the caller (DDP's gradient buckets), and ``Work.wait()``/
``get_future()`` complete when the results are in place (as with NCCL, a tensor read
before then may hold part of the result).
"""

import atexit
import os
import threading
import time
import weakref

import torch
import torch._C._distributed_c10d as _c10d
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import ReduceOp

__all__ = ["TpuBackend"]

_BACKEND = "tpu"


class _Work(dist.Work):
    """A collective in flight: Gloo's work, then `finish` (writing the results back into the
    tpu tensors) when it completes. Its future yields `result`."""

    def __init__(self, gloo_work, finish, result):
        super().__init__()
        self._result = result

        def done(f):
            f.value()  # raises Gloo's error, which the chained future then holds
            if finish is not None:
                finish()
            return result

        if gloo_work is None:
            self._future = torch.futures.Future()
            self._future.set_result(done(_READY))
            return
        try:
            self._future = _then(gloo_work.get_future(), done)
        except RuntimeError:
            # Gloo's point-to-point works have no future: a thread waits for this one.
            self._future = torch.futures.Future()
            _track(gloo_work.is_completed, done)
            threading.Thread(
                target=_complete, args=(gloo_work, done, self._future), daemon=True
            ).start()

    def wait(self, timeout=None):
        self._future.wait()
        return True

    def is_completed(self):
        return self._future.done()

    def is_success(self):
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def exception(self):
        try:
            self._future.value()
        except Exception as e:
            return e
        return None

    def get_future(self):
        return self._future

    def result(self):
        return self._result


# Completion callbacks run on Gloo's threads, which take the GIL to run them and to release
# them. A thread that takes it while the interpreter finalizes is ended mid-C++ and aborts the
# process ("terminate called without an active exception"): at exit, wait for the callbacks
# whose work completed until their threads are done with them.
_running = {}


def _track(completed, fn):
    """Tracks `fn`, a callback a Gloo-side thread runs once `completed()`, until released."""
    key = weakref.ref(fn, lambda r: _running.pop(r, None))
    _running[key] = completed


def _then(fut, fn):
    _track(fut.done, fn)
    return fut.then(fn)


@atexit.register
def _drain(timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not any(completed() for completed in list(_running.values())):
                return
        except RuntimeError:
            return
        time.sleep(0.005)


def _complete(gloo_work, done, future):
    try:
        gloo_work.wait()
        future.set_result(done(_READY))
    except Exception as e:
        future.set_exception(e)


_READY = torch.futures.Future()
_READY.set_result(None)


def _host(t):
    """A contiguous host copy of tpu tensor `t` for Gloo to overwrite (bool as uint8)."""
    c = t.detach().to("cpu").contiguous()
    return c.to(torch.uint8) if c.dtype == torch.bool else c


def _host_in(t):
    """Tpu tensor `t`'s data for Gloo to read only: its buffer itself where that is host
    memory (the CPU plugin; kept from donation while the returned tensor lives)."""
    if t.dtype != torch.bool:
        a = torch.ops.torch_pjrt.host_alias(t.detach())
        if a is not None:
            return a if a.is_contiguous() else a.contiguous()
    return _host(t)


def _host_inout(t):
    """Tpu tensor `t`'s own buffer for Gloo to overwrite with the result, as an in-place op
    would (the CPU plugin; `t` dense and its buffer held by nothing else once the work
    queued before has read it), or None: copy in and out."""
    if t.dtype == torch.bool:
        return None
    a = torch.ops.torch_pjrt.host_alias(t.detach(), True)
    return a if a is not None and a.is_contiguous() else None


def _scratch(t):
    """Host memory for Gloo to write tpu tensor `t`'s result into (its value is not read)."""
    return torch.empty(t.shape, dtype=torch.uint8 if t.dtype == torch.bool else t.dtype)


def _outs(tensors, fill=_scratch):
    """Host tensors for Gloo to write the results of tpu `tensors` into: their own buffers
    where allowed (`_host_inout`), else `fill(t)` (fresh memory; `_host`: a copy of the
    value, for Gloo to reduce in place); and which are their own (None where not)."""
    shared = [_host_inout(t) for t in tensors]
    return [fill(t) if a is None else a for t, a in zip(tensors, shared, strict=True)], shared


def _nested_outs(output_lists):
    """`_outs` of lists of outputs (all_gather, gather): the nested host lists Gloo takes,
    the flat outputs, their flat host tensors and which are their own."""
    flat_t = [o for lst in output_lists for o in lst]
    flat_h, shared = _outs(flat_t)
    it = iter(flat_h)
    return [[next(it) for _ in lst] for lst in output_lists], flat_t, flat_h, shared


def _back(dst, host):
    """Makes Gloo's result `host` the value of tpu tensor `dst`: its buffer, without a copy,
    where `dst` is a whole dense storage on the CPU plugin (`host` is not used again)."""
    if dst.dtype == torch.bool:
        host = host != 0
    host = host.view(dst.shape) if host.shape != dst.shape else host
    with torch.no_grad():
        if not torch.ops.torch_pjrt.adopt_host(dst, host):
            dst.copy_(host)


def _split_op(op, dtype):
    """Gloo's reduce op for `op` and a host-side scale applied after it (AVG: 1/world size,
    PREMUL_SUM: its factor), as (gloo op, factor or None, divide by world size)."""
    kind = op.op if hasattr(op, "op") else op
    if kind == ReduceOp.RedOpType.AVG:
        return ReduceOp.SUM, None, True
    if kind == ReduceOp.RedOpType.PREMUL_SUM:
        factor = op.factor if hasattr(op, "factor") else None
        return ReduceOp.SUM, factor, False
    if dtype == torch.bool and kind == ReduceOp.RedOpType.SUM:
        return ReduceOp.MAX, None, False  # logical or, as NCCL's bool sum reads
    if dtype == torch.bool and kind == ReduceOp.RedOpType.PRODUCT:
        return ReduceOp.MIN, None, False
    return op, None, False


_CHECK = os.environ.get("TORCH_TPU_DIST_CHECK", "1") != "0"
_OP_CODES = {
    n: i
    for i, n in enumerate(
        ["all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
         "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
         "gather", "scatter"]
    )
}
_DTYPE_CODES = {
    d: i
    for i, d in enumerate(
        [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
         torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
    )
}


def _opts(cls, **kw):
    o = cls()
    for k, v in kw.items():
        setattr(o, k, v)
    return o


class TpuBackend(_C10dBackend):
    """c10d backend for tpu tensors (see the module's docstring)."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self._rank, self._size, self._timeout = rank, size, timeout
        # torchrun's agent keeps its store across restarts: without the attempt in the
        # keys a restarted rank would read the dead attempt's Gloo addresses and time out.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = dist.PrefixStore(f"tpu_gloo/{attempt}/", store)
        self._gloo = dist.ProcessGroupGloo(prefix, rank, size, timeout)
        _use_local_device()

    def getBackendName(self):  # noqa: N802 (c10d's name)
        return _BACKEND

    # C++ reads these through properties that, on a Python subclass, look the same name up
    # again on the instance: without a Python definition they recurse forever.
    @property
    def supports_coalescing(self):
        return False

    @property
    def supports_splitting(self):
        return False

    @property
    def supports_shrinking(self):
        return False

    @property
    def supports_reconfigure(self):
        return False

    @property
    def supports_window(self):
        return False

    @property
    def _supports_time_estimate(self):
        return False

    @property
    def options(self):
        return _C10dBackend.Options(_BACKEND, self._timeout)

    def name(self):
        return _BACKEND

    # --- helpers --------------------------------------------------------------------------

    def _check(self, name, tensors, sizes=True):
        """Refuses a collective whose ranks disagree on dtype or (with `sizes`) element
        counts: Gloo would exchange mismatched buffers silently. One small all_gather of
        (op, dtype, elements) per collective; TORCH_TPU_DIST_CHECK=0 turns it off."""
        if not _CHECK or self._size == 1:
            return
        mine = torch.tensor(
            [
                _OP_CODES[name],
                _DTYPE_CODES.get(tensors[0].dtype if tensors else None, -1),
                sum(t.numel() for t in tensors) if sizes else -1,
            ],
            dtype=torch.int64,
        )
        every = torch.empty(self._size * 3, dtype=torch.int64)
        self._gloo._allgather_base(every, mine, _c10d.AllgatherOptions()).wait()
        every = every.view(self._size, 3)
        if (every == mine).all():
            return
        names = {v: k for k, v in _OP_CODES.items()}
        dtypes = {v: k for k, v in _DTYPE_CODES.items()}
        desc = "; ".join(
            f"rank {r}: {names.get(int(o), '?')} of {int(n)} elements of {dtypes.get(int(dt))}"
            if n >= 0
            else f"rank {r}: {names.get(int(o), '?')} of {dtypes.get(int(dt))}"
            for r, (o, dt, n) in enumerate(every.tolist())
        )
        raise RuntimeError(
            f"{name}: the ranks' calls do not match ({desc}); every rank must call the same "
            "collective with tensors of the same dtype and size"
        )

    def _reduce(self, tensors, op, launch, write_back=True):
        """`launch(host_tensors, gloo_op)` on host tensors (copies, or the tensors' own buffers
        where `_outs` allows); with `write_back` their results go back into `tensors`, scaled
        as `op` asks."""
        if self._size == 1:
            return self._alone_reduce(tensors, op)
        # Gloo reduces in place: into the tensor's own buffer where that is allowed (not
        # where the result is not kept: Gloo uses a non-root's tensor as scratch).
        if write_back:
            hosts, shared = _outs(tensors, fill=_host)
        else:
            hosts, shared = [_host(t) for t in tensors], None
        gop, factor, mean = _split_op(op, tensors[0].dtype if tensors else None)
        if factor is not None:
            f = factor.item() if isinstance(factor, torch.Tensor) else factor
            hosts = [h.mul_(f) if h.is_floating_point() else h for h in hosts]
        work = launch(hosts, gop)
        if not write_back:
            return _Work(work, None, list(tensors))
        size = self._size
        # Made here: a closure that held `self` could drop the last reference to the backend
        # on Gloo's thread, whose destructor then joins that thread (an abort at exit).
        write = self._copy_back(tensors, hosts, shared)

        def finish():
            for h in hosts if mean else ():
                if h.is_floating_point():
                    h.div_(size)
                else:
                    h.floor_divide_(size)
            write()

        return _Work(work, finish, list(tensors))

    # World size 1 (one process, or a subgroup of one rank): each collective's result is
    # the rank's own data, computed on the device; no host round trip, no Gloo.

    @staticmethod
    def _alone_reduce(tensors, op):
        _, factor, _ = _split_op(op, tensors[0].dtype if tensors else None)
        if factor is not None:
            with torch.no_grad():
                for t in tensors:
                    if t.is_floating_point():
                        t.mul_(factor)
        return _Work(None, None, list(tensors))

    @staticmethod
    def _alone_copies(outputs, inputs, result):
        for o, i in zip(outputs, inputs, strict=True):
            _assign(o, i.reshape(o.shape))
        return _Work(None, None, result)

    @staticmethod
    def _copy_back(outputs, hosts, shared):
        """Gives `outputs` Gloo's results in `hosts`, except those written in place."""

        def finish():
            for o, h, a in zip(outputs, hosts, shared, strict=True):
                if a is None:
                    _back(o, h)

        return finish

    # --- collectives (c10d's Backend method names) ----------------------------------------

    def allreduce(self, tensors, opts):
        self._check("all_reduce", tensors)
        return self._reduce(
            tensors,
            opts.reduceOp,
            lambda h, op: self._gloo.allreduce(h, _opts(_c10d.AllreduceOptions, reduceOp=op)),
        )

    def allreduce_coalesced(self, tensors, opts):
        self._check("all_reduce", tensors)
        return self._reduce(
            tensors,
            opts.reduceOp,
            lambda h, op: self._gloo.allreduce_coalesced(
                h, _opts(_c10d.AllreduceCoalescedOptions, reduceOp=op)
            ),
        )

    def reduce(self, tensors, opts):
        self._check("reduce", tensors)
        root = opts.rootRank
        launch = lambda h, op: self._gloo.reduce(  # noqa: E731
            h, _opts(_c10d.ReduceOptions, reduceOp=op, rootRank=root)
        )
        # Only the root's tensor changes (as with NCCL; Gloo uses the others as scratch).
        return self._reduce(tensors, opts.reduceOp, launch, write_back=self._rank == root)

    def broadcast(self, tensors, opts):
        self._check("broadcast", tensors)
        if self._size == 1:
            return _Work(None, None, list(tensors))
        root = self._rank == opts.rootRank
        hosts, shared = ([_host_in(t) for t in tensors], None) if root else _outs(tensors)
        work = self._gloo.broadcast(
            hosts, _opts(_c10d.BroadcastOptions, rootRank=opts.rootRank, rootTensor=opts.rootTensor)
        )
        finish = None if root else self._copy_back(tensors, hosts, shared)
        return _Work(work, finish, list(tensors))

    def allgather(self, output_tensors, input_tensors, opts):
        self._check("all_gather", input_tensors)
        if self._size == 1:
            return self._alone_copies([lst[0] for lst in output_tensors], input_tensors,
                                      output_tensors)
        ins = [_host_in(t) for t in input_tensors]  # first: an output sharing it is copied
        outs, flat_t, flat_h, shared = _nested_outs(output_tensors)
        work = self._gloo.allgather(outs, ins, _c10d.AllgatherOptions())
        return _Work(work, self._copy_back(flat_t, flat_h, shared), output_tensors)

    def all_gather_single(self, output, input, opts):
        self._check("all_gather_into_tensor", [input])
        if self._size == 1:
            return self._alone_copies([output], [input], [output])
        inp = _host_in(input)  # first: an output sharing its buffer is not written in place
        (out,), shared = _outs([output])
        work = self._gloo._allgather_base(out, inp, _c10d.AllgatherOptions())
        return _Work(work, self._copy_back([output], [out], shared), [output])

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return _All(works, list(outputs))

    def allgather_coalesced(self, output_lists, input_tensors, opts):
        return self.allgather(output_lists, input_tensors, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        self._check("reduce_scatter", output_tensors)
        # Gloo has no reduce_scatter: an allreduce of each rank's stacked inputs, of which
        # each rank keeps its own row.
        works = []
        for out, ins in zip(output_tensors, input_tensors, strict=True):
            stacked = torch.stack([i.detach() for i in ins])
            w = self._reduce(
                [stacked],
                opts.reduceOp,
                lambda h, op: self._gloo.allreduce(h, _opts(_c10d.AllreduceOptions, reduceOp=op)),
            )
            works.append(_Then(w, lambda out=out, row=stacked[self._rank]: _assign(out, row)))
        return _All(works, list(output_tensors))

    def reduce_scatter_single(self, output, input, opts):
        pieces = list(input.detach().reshape(self._size, *output.shape).unbind(0))
        return self.reduce_scatter([output], [pieces], opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        works = [
            self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)
        ]
        return _All(works, list(outputs))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        self._check("all_to_all_single", [input], sizes=not input_split_sizes)
        if self._size == 1:
            return self._alone_copies([output], [input], [output])
        inp = _host_in(input)
        (out,), shared = _outs([output])
        work = self._gloo.alltoall_base(
            out, inp, list(output_split_sizes), list(input_split_sizes), _c10d.AllToAllOptions()
        )
        return _Work(work, self._copy_back([output], [out], shared), [output])

    def alltoall(self, output_tensors, input_tensors, opts):
        self._check("all_to_all", input_tensors, sizes=False)
        if self._size == 1:
            return self._alone_copies(output_tensors, input_tensors, list(output_tensors))
        ins = [_host_in(i) for i in input_tensors]
        outs, shared = _outs(output_tensors)
        work = self._gloo.alltoall(outs, ins, _c10d.AllToAllOptions())
        return _Work(work, self._copy_back(output_tensors, outs, shared), list(output_tensors))

    def gather(self, output_tensors, input_tensors, opts):
        self._check("gather", input_tensors)
        if self._size == 1:
            return self._alone_copies([lst[0] for lst in output_tensors], input_tensors,
                                      output_tensors)
        ins = [_host_in(t) for t in input_tensors]
        outs, flat_t, flat_h, shared = _nested_outs(output_tensors)
        work = self._gloo.gather(outs, ins, _opts(_c10d.GatherOptions, rootRank=opts.rootRank))
        return _Work(work, self._copy_back(flat_t, flat_h, shared), output_tensors)

    def scatter(self, output_tensors, input_tensors, opts):
        self._check("scatter", output_tensors)
        if self._size == 1:
            return self._alone_copies(output_tensors, [lst[0] for lst in input_tensors],
                                      list(output_tensors))
        ins = [[_host_in(t) for t in lst] for lst in input_tensors]
        outs, shared = _outs(output_tensors)
        work = self._gloo.scatter(outs, ins, _opts(_c10d.ScatterOptions, rootRank=opts.rootRank))
        return _Work(work, self._copy_back(output_tensors, outs, shared), list(output_tensors))

    def send(self, tensors, dst, tag):
        hosts = [_host_in(t) for t in tensors]
        # `hosts` stays referenced by the work's callback until Gloo has sent it.
        return _Work(self._gloo.send(hosts, dst, tag), lambda: hosts, list(tensors))

    def recv(self, tensors, src, tag):
        hosts, shared = _outs(tensors)
        work = self._gloo.recv(hosts, src, tag)
        return _Work(work, self._copy_back(tensors, hosts, shared), list(tensors))

    def barrier(self, opts):
        torch.tpu.synchronize()
        if self._size == 1:
            return _Work(None, None, [])
        return _Work(self._gloo.barrier(_c10d.BarrierOptions()), None, [])


# Dynamo compiles the Python frames that C++ calls into while a compiled function runs (DDP's
# reducer broadcasts from a compiled forward): the backend works on host memory and Gloo,
# nothing to trace, so its collectives always run as written.
for _name in (
    "allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "all_gather_single",
    "all_gather_single_coalesced", "allgather_coalesced", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_single_coalesced", "all_to_all_single", "alltoall",
    "gather", "scatter", "send", "recv", "barrier",
):
    setattr(TpuBackend, _name, torch._dynamo.disable(getattr(TpuBackend, _name), recursive=True))


def _assign(dst, src):
    with torch.no_grad():
        dst.copy_(src)


class _Then(_Work):
    """`work`, then `fn` once it completed."""

    def __init__(self, work, fn):
        dist.Work.__init__(self)
        self._result = work.result()

        def done(f):
            f.value()
            fn()
            return self._result

        self._future = _then(work.get_future(), done)


class _All(_Work):
    """Several works as one: complete when all are."""

    def __init__(self, works, result):
        dist.Work.__init__(self)
        self._result = result
        futs = torch.futures.collect_all([w.get_future() for w in works])

        def done(f):
            for x in f.value():
                x.value()
            return result

        self._future = _then(futs, done)


def _use_local_device():
    """Under a launcher that sets LOCAL_RANK (torchrun), each rank's `tpu` is its local
    device, as each rank's `cuda` is with NCCL: tpu:LOCAL_RANK (modulo the devices), unless
    the script already chose one."""
    local = os.environ.get("LOCAL_RANK")
    if local is None or torch.tpu.current_device() != 0:
        return
    torch.tpu.set_device(int(local) % torch.tpu.device_count())


def _create(store, rank, size, timeout):
    return TpuBackend(store, rank, size, timeout)


def register():
    """Registers the backend (once) and makes it tpu's default."""
    if _BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(_BACKEND, _create, devices=["tpu"])
    dist.Backend.default_device_backend_map["tpu"] = _BACKEND
