"""``torch.tpu`` streams and events: CUDA's API over the runtime's streams (runtime
``stream.rs``; the shim's device guard implements them, so ``torch.Stream(device="tpu")``,
``torch.accelerator.current_stream()`` and autograd's stream handling reach the same
queues)."""

import contextlib

import torch

from . import _C

__all__ = ["Stream", "Event", "StreamContext", "current_stream", "default_stream",
           "set_stream", "stream", "device_of"]


def _index(device):
    from .device import _index as index

    return index(device)


class Stream(torch.Stream):
    """An ordered queue of device work. Work on different streams may run concurrently;
    order them with ``wait_stream``/``wait_event``. ``Stream()`` takes a stream of the
    current device from a pool of side streams (as CUDA's streams do)."""

    def __new__(cls, device=None, priority=0, **kwargs):
        if kwargs:  # wrapping an existing stream: stream_id, device_index, device_type
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, device=torch.device("tpu", _index(device)),
                               priority=priority)

    def wait_event(self, event):
        event.wait(self)

    def wait_stream(self, stream):
        self.wait_event(stream.record_event())

    def record_event(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    def __eq__(self, other):
        return isinstance(other, torch.Stream) and (
            (self.stream_id, self.device_index, self.device_type)
            == (other.stream_id, other.device_index, other.device_type))

    def __hash__(self):
        return hash((self.stream_id, self.device_index, self.device_type))

    def __repr__(self):
        return f"<torch.tpu.Stream device=tpu:{self.device_index} stream_id={self.stream_id}>"


class Event(torch.Event):
    """A point in a stream's work: ``query``/``synchronize`` once the work before it has
    finished, ``wait`` makes another stream wait for it, ``elapsed_time`` is the device time
    between two events in milliseconds."""

    def __new__(cls, enable_timing=False, blocking=False, interprocess=False):
        return super().__new__(cls, device="tpu", enable_timing=enable_timing,
                               blocking=blocking, interprocess=interprocess)

    def record(self, stream=None):
        super().record(current_stream() if stream is None else stream)

    def wait(self, stream=None):
        super().wait(current_stream() if stream is None else stream)

    def elapsed_time(self, end_event):
        """Milliseconds of device time from this event to ``end_event``; both must have
        completed (``synchronize()`` the later one first), as on CUDA."""
        if not (self.query() and end_event.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return _C.event_elapsed(self.event_id, end_event.event_id)


def _wrap(s):
    return Stream(stream_id=s.stream_id, device_index=s.device_index,
                  device_type=s.device_type)


def current_stream(device=None):
    """The calling thread's current stream on ``device``."""
    return _wrap(torch.accelerator.current_stream(_index(device)))


def default_stream(device=None):
    """The device's default stream (stream 0), where work goes unless a stream is set."""
    cur = torch.accelerator.current_stream(_index(device))
    return Stream(stream_id=0, device_index=cur.device_index, device_type=cur.device_type)


def set_stream(stream):
    """Makes ``stream`` the current stream of its device (None: no change)."""
    if stream is not None:
        torch.accelerator.set_stream(stream)


class StreamContext:
    """Selects ``stream`` (and its device) for the body; None does nothing."""

    def __init__(self, stream):
        self.stream = stream
        self._prev = None
        self._dev = None

    def __enter__(self):
        if self.stream is None:
            return None
        from .device import current_device, set_device

        self._dev = current_device()
        if self.stream.device_index != self._dev:
            set_device(self.stream.device_index)
        self._prev = torch.accelerator.current_stream(self.stream.device_index)
        torch.accelerator.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc):
        if self.stream is None:
            return False
        from .device import set_device

        torch.accelerator.set_stream(self._prev)
        if self._dev != self.stream.device_index:
            set_device(self._dev)
        return False


def stream(stream):
    """``with torch.tpu.stream(s):`` runs the body's tpu work on ``s``."""
    return StreamContext(stream)


@contextlib.contextmanager
def device_of(obj):
    """Makes the device of tensor ``obj`` current in the body (nothing for CPU tensors)."""
    from .device import device

    if isinstance(obj, torch.Tensor) and obj.device.type == "tpu":
        with device(obj.device):
            yield
    else:
        yield
