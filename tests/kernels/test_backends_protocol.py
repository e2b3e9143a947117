"""Every backend has its kind's declared interface (``kernels/backends.py``): each method of the
Protocol, with the Protocol's parameters in its order (no parameter more, none it ignores)."""

import inspect

import pytest

from mindspeed_cez import kernels
from mindspeed_cez.kernels import cann
from mindspeed_cez.kernels import backends, chunked_linear, torch_reference


def _parameters(fn):
    return [p.name for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def _protocol_methods(protocol):
    return {name: fn for name, fn in vars(protocol).items() if inspect.isfunction(fn) and not name.startswith("_")}


def _backends():
    cases = [("torch", backends.CrossEntropyBackend, torch_reference),
             ("gemm", backends.LinearBackend, chunked_linear.ChunkedLinear(torch_reference)),
             ("cann", backends.WholeLossBackend, cann)]
    if kernels.triton_available():
        from mindspeed_cez.kernels import triton_linear_cross_entropy

        cases += [("triton", backends.CrossEntropyBackend, kernels.get_backend("triton")),
                  ("triton linear", backends.LinearBackend, triton_linear_cross_entropy),
                  ("gemm of triton", backends.LinearBackend, chunked_linear.ChunkedLinear(kernels.get_backend("triton")))]
    return cases


@pytest.mark.parametrize("name,protocol,backend", _backends(), ids=[c[0] for c in _backends()])
def test_backend_has_its_kinds_interface(name, protocol, backend):
    assert isinstance(backend, protocol), name
    for method, declared in _protocol_methods(protocol).items():
        assert _parameters(getattr(backend, method)) == _parameters(declared), (name, method)


def test_the_ops_pick_backends_of_the_declared_kinds():
    import torch

    assert isinstance(kernels.backend_for(torch.device("cpu")), backends.CrossEntropyBackend)
    for name in (None, *kernels.LINEAR_BACKENDS):
        if name == "triton" and not kernels.triton_available():
            continue
        assert isinstance(kernels.linear_backend_for(torch.device("cpu"), name), backends.LinearBackend), name


def test_a_loss_spec_is_named_spec():
    """``loss`` names a tensor in the package; a :class:`LossSpec` parameter of the interfaces is ``spec``."""
    taking_one = 0
    for protocol in (backends.CrossEntropyBackend, backends.LinearBackend, backends.WholeLossBackend):
        for method, declared in _protocol_methods(protocol).items():
            parameters = inspect.signature(declared).parameters
            specs = [name for name, p in parameters.items() if p.annotation in (backends.LossSpec, "LossSpec")]
            assert specs in ([], ["spec"]), (protocol.__name__, method, list(parameters))
            taking_one += bool(specs)
    assert taking_one >= 8, taking_one
