"""OpInfo error inputs: each op's ``error_inputs`` raise on tpu what they raise on the CPU.

PyTorch's OpInfo database lists, for 200+ ops, inputs that must raise (bad shapes, dtypes,
dimensions, out= tensors, indices). Each is run on the CPU and on tpu; where the CPU raises,
tpu must raise the same exception type with the same first line of message (an error found
on the device after the op, such as an index out of range, is raised by the next
synchronization). Inputs the CPU accepts (CUDA-only cases) are skipped.
"""

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import torch_pjrt  # noqa: F401

XFAIL = {
    # Its error inputs pair a tensor with a meta one: the message names the devices (the CPU
    # says "cpu and meta", tpu "tpu:0 and cpu").
    "gradient": "the message names the devices, which differ by device",
}


def _name(op):
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def _call(op, sample, sync=False):
    def run():
        op(sample.input, *sample.args, **sample.kwargs)
        if sync:
            torch.tpu.synchronize()
    return run


OPS = [op for op in op_db if op.error_inputs_func is not None]


@pytest.mark.parametrize("op", [
    pytest.param(op, id=_name(op),
                 marks=[pytest.mark.xfail(reason=XFAIL[_name(op)], strict=True)]
                 if _name(op) in XFAIL else [])
    for op in OPS
])
def test_error_inputs_raise_as_on_the_cpu(op):
    torch.manual_seed(0)
    try:
        inputs = list(op.error_inputs("tpu"))
    except NotImplementedError as e:
        pytest.skip(reason=f"its error inputs cannot be made on tpu: {str(e).splitlines()[0]}")
    torch.manual_seed(0)
    cpu = list(op.error_inputs("cpu"))
    failures = []
    for k, ei in enumerate(inputs):
        sample = ei.sample_input
        if len(cpu) == len(inputs):  # the same cases, made on the CPU (views and aliasing kept)
            twin = cpu[k].sample_input
        else:  # device-dependent cases: this one's tensors copied to the CPU
            twin = sample.transform(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t)
        expected = _raised(_call(op, twin))
        if expected is None:  # the CPU accepts it (a case for other devices)
            continue
        actual = _raised(_call(op, sample, sync=True))
        if actual is None:
            failures.append(f"#{k}: no error; CPU raised {type(expected).__name__}: {expected}")
        elif type(actual) is not type(expected):
            failures.append(f"#{k}: {type(actual).__name__}: {actual}; CPU raised "
                            f"{type(expected).__name__}: {expected}")
        elif str(actual).split("\n")[0] != str(expected).split("\n")[0]:
            failures.append(f"#{k}: message {str(actual).splitlines()[0]!r}; CPU: "
                            f"{str(expected).splitlines()[0]!r}")
    assert not failures, "\n".join(failures)
