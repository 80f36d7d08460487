"""Int8 Linear layers for a CPU target: int8 weights (one scale per output channel) times int8 activations (one
scale per token), integer matmul (`torch._int_mm`), float output.

Torch's dynamic quantisation (`quantize_dynamic`) scales the activations per tensor: one token's output then depends
on the other tokens of the same call (by up to 1 % of the activations' range), so a tree verify would see other
logits than a one-token decode. Here every token is scaled on its own and the int32 accumulation is exact: a row's
output of this layer is bit for bit the same whatever else is in the call. (The rest of the model, attention
above all, still differs by ~1e-6 between call shapes in fp32, and rounding activations to int8 can turn such a
difference into one int8 step; see the README for what that does to greedy equality on the real target.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("moa.quant")
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "asimddp")  # x86 VNNI / AMX, Arm dot product


def int8_matmuls_native(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether this CPU has int8 dot-product instructions (without them `torch._int_mm` emulates them and an int8
    target runs about twice as slowly as fp32); None where /proc/cpuinfo does not say."""
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return None
    return any(f in flags for f in INT8_DOT_FLAGS)


class Int8Linear(nn.Module):
    """A drop-in for `nn.Linear` (inference only): y = (q(x) @ W_int8^T) * x_scale * w_scale + bias."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("qweight_t", qweight.t())  # (in, out): the layout torch._int_mm takes
        self.register_buffer("scale", scale)  # (out,)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "Int8Linear":
        w = linear.weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-12) / 127
        qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        return cls(qweight, scale, bias)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight (out, in), for code that reads a Linear's weight (e.g. a drafter's LM head copy)."""
        return self.qweight_t.t().float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1]).float()
        x_scale = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
        xq = torch.round(x / x_scale).to(torch.int8)
        y = torch._int_mm(xq, self.qweight_t).float() * (x_scale * self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def quantize_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` inside `model` by an `Int8Linear`, in place; returns how many. Warns on a CPU
    without int8 dot products, where this makes the model slower, not faster."""
    if int8_matmuls_native() is False:
        log.warning("this CPU has no int8 dot-product instructions (VNNI, AMX or Arm dotprod): an int8 target runs "
                    "about twice as slowly as fp32 here (docs/measurements.md)")
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear.from_float(child))
                replaced += 1
    return replaced
