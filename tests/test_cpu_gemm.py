"""Linear layers on oneDNN's GEMM: the same numbers as nn.Linear, and nn.Linear wherever the kernel does not serve."""

import pytest
import torch
from torch import nn

from models.cpu_gemm import MIN_WEIGHT, OneDNNLinear, use_mkl, use_onednn

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch without oneDNN")


def ops_run_by(fn) -> set[str]:
    with torch.profiler.profile() as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def wide_linear(bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(576, 1536, bias=bias)


@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (2, 5, 576)])
def test_onednn_linear_computes_what_nn_linear_computes(shape):
    reference = wide_linear()
    layer = wide_linear()
    assert use_onednn(nn.Sequential(layer)) == 1 and type(layer) is OneDNNLinear
    x = torch.randn(*shape)
    with torch.no_grad():
        assert "mkldnn::_linear_pointwise" in ops_run_by(lambda: layer(x))
        assert torch.allclose(layer(x), reference(x), atol=1e-5, rtol=1e-5)
        assert layer(x).shape == (*shape[:-1], 1536)


def test_gradients_autocast_and_other_dtypes_take_nn_linear():
    layer = wide_linear()
    use_onednn(nn.Sequential(layer))
    x = torch.randn(3, 576, requires_grad=True)
    assert "mkldnn::_linear_pointwise" not in ops_run_by(lambda: layer(x))
    layer(x).sum().backward()  # the oneDNN op has no backward (its inputs would get no gradient)
    assert x.grad is not None and layer.weight.grad is not None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(2, 576)).dtype == torch.bfloat16
    double = wide_linear().double()
    use_onednn(nn.Sequential(double))
    with torch.no_grad():
        assert double(torch.randn(2, 576, dtype=torch.float64)).dtype == torch.float64


def test_small_layers_stay_on_mkl_and_tied_weights_stay_tied():
    model = nn.Sequential(nn.Linear(64, 64), wide_linear(bias=False))
    small, wide = model[0], model[1]
    assert small.weight.numel() < MIN_WEIGHT
    embed = nn.Embedding(1536, 576)
    wide.weight = embed.weight
    assert use_onednn(model) == 1
    assert type(small) is nn.Linear and type(wide) is OneDNNLinear and wide.weight is embed.weight
    assert use_mkl(model) == 1 and type(wide) is nn.Linear and wide.weight is embed.weight
