"""Float32 Linear layers on oneDNN's GEMM instead of MKL's, for inference on a CPU.

On this project's CPU (AMD EPYC, one thread) oneDNN is much faster for wide layers (the default target's LM head,
576 -> 49,152: 9.5 -> 5.7 ms for one token, 24 -> 10 ms for eight; a 16k draft head 5.0 -> 1.4 ms) and for calls of
several tokens (576 -> 1,536 over 8 tokens: 219 -> 137 us), about even for one token through a mid-sized layer, and
slower for small layers, where its ~10 us a call dominates: layers under MIN_WEIGHT elements stay on MKL. The
target's logits stay as consistent across call shapes as before (8 tokens in one call vs one by one: ~5e-5 either
way), so speculation stays lossless. Anything this kernel does not serve falls back to `nn.Linear`: gradients,
autocast (training), other dtypes, tracing (ONNX export, torch.compile).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

MIN_WEIGHT = 1 << 18  # weight elements from which oneDNN's kernel beats its per-call overhead here


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` whose float32 CPU inference forward is oneDNN's matmul (same weights, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype != torch.float32 or self.weight.dtype != torch.float32 or x.device.type != "cpu"
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
                or torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling()):
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.weight, self.bias, "none", [], "")
        return y.view(*shape[:-1], self.out_features)


def use_onednn(model: nn.Module) -> int:
    """Turn every plain `nn.Linear` of `model` with at least MIN_WEIGHT weights into a `OneDNNLinear` in place (tied
    weights stay tied); returns how many. A no-op where PyTorch has no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return 0
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.numel() >= MIN_WEIGHT]
    for m in linears:
        m.__class__ = OneDNNLinear
    return len(linears)


def use_mkl(model: nn.Module) -> int:
    """Undo `use_onednn`: every `OneDNNLinear` of `model` back to a plain `nn.Linear` (for comparisons)."""
    layers = [m for m in model.modules() if type(m) is OneDNNLinear]
    for m in layers:
        m.__class__ = nn.Linear
    return len(layers)
