"""bf16 matrix products computed with float32 kernels, for CPUs without fast bf16 (`model.cpu_bf16`).

Under bf16 autocast a matrix product rounds its operands to bfloat16, multiplies them accumulating in
float32, and rounds the result to bfloat16. A CPU with AVX-512 BF16 or AMX has instructions for that; on one
with AVX2 only, torch's bf16 kernels are many times slower than its float32 ones (devices/bf16.py: a
SmolLM2 projection's forward and backward, [768 x 576] x [576 x 1536], took 1,201 ms in bf16 against 29 ms in
fp32 on an AMD EPYC). Within `EmulatedBf16` the same product is computed by the float32 kernels: each operand
rounded to bf16 and widened back (exact), a float32 product (float32 accumulation, as the bf16 kernels
have), the result rounded to bf16. Every value has the bf16 format it would have natively; only the order
of the additions differs, as between any two kernels (tests/models/test_emulated_bf16.py: within one bf16
unit in the last place of torch's own kernels, and bit-equal for most outputs).

Gradients follow the same rule: the backward's products take bf16 operands and round their results to
bf16, as the native backward does. `F.linear`, most of a transformer's products, goes through `_Linear`,
whose backward is written out and which keeps its operands for it in bf16 (the memory the native kernels
keep); the other products (`matmul`, `mm`, `bmm`, `addmm`, `baddbmm`, `einsum`, `grouped_mm`) through
widened copies whose float32 products autograd records.

The mode sees the Python calls made while it is entered, and the backward pass runs outside it (torch
takes a mode off its stack while the mode handles a call, `backward` included). So code that makes bf16
products of its own in a backward pass asks `emulating()` in its forward and enters the mode in its
backward (trainer/learner_side/head.py's fused head), and a checkpointed forward recomputed in the backward pass gets
the mode through `recompute_context` (models/precision.py). A product the mode does not see still runs,
natively: correct, only slow.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

BF16 = torch.bfloat16

# the products autocast runs in bf16 on the CPU (torch's autocast lower-precision list); others are
# emulated only when their operands are bf16 already
AUTOCAST_LOW = {
    F.linear,
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.mm,
    torch.Tensor.mm,
    torch.bmm,
    torch.Tensor.bmm,
    torch.addmm,
    torch.Tensor.addmm,
    torch.baddbmm,
    torch.Tensor.baddbmm,
    torch.einsum,
}
PRODUCTS = AUTOCAST_LOW | ({F.grouped_mm} if hasattr(F, "grouped_mm") else set())


class _Linear(torch.autograd.Function):
    """y = x W^T + b for bf16 x, W, b: a float32 product of the widened operands, rounded to bf16; the
    backward's products the same way. Saves x and W in bf16."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(BF16)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.float()).to(BF16)
        rows = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = (rows.T @ x.reshape(-1, x.shape[-1]).float()).to(BF16)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0).to(BF16)
        return grad_x, grad_w, grad_b


def _floating(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _runs_in_bf16(func, args, kwargs) -> bool:
    """Whether torch would compute this product in bf16: on the CPU, under bf16 autocast for the products
    autocast lowers (float32 and bf16 operands; autocast leaves float64 alone), or with every floating
    operand bf16 already."""
    tensors = [t for t in tree_leaves((args, kwargs)) if _floating(t)]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return False
    if all(t.dtype == BF16 for t in tensors):
        return True
    autocast_low = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == BF16
    lowered = all(t.dtype in (torch.float32, BF16) for t in tensors)
    return autocast_low and func in AUTOCAST_LOW and lowered


def emulated(func, args, kwargs):
    """`func(*args, **kwargs)`, a product torch would compute in bf16, computed as the module docstring
    says (an `out=` tensor is filled with the rounded result)."""
    out = kwargs.pop("out", None)
    with torch.autocast("cpu", enabled=False):
        if func is F.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            result = _Linear.apply(x.to(BF16), weight.to(BF16), None if bias is None else bias.to(BF16))
        else:
            widened = tree_map(lambda t: t.to(BF16).float() if _floating(t) else t, (args, kwargs))
            result = func(*widened[0], **widened[1]).to(BF16)
    if out is None:
        return result
    return out.copy_(result)


_entered = threading.local()  # how many EmulatedBf16 contexts this thread is in


def emulating() -> bool:
    """Whether this thread is within `EmulatedBf16` (a forward that records a backward of its own asks)."""
    return getattr(_entered, "depth", 0) > 0


def emulated_if(flag: bool):
    """`EmulatedBf16()` if `flag`, else a context that does nothing (a backward pass's choice)."""
    return EmulatedBf16() if flag else contextlib.nullcontext()


def recompute_context() -> tuple:
    """`torch.utils.checkpoint`'s `context_fn`: a checkpointed forward run within `EmulatedBf16` is
    recomputed within it too (called at the forward, so it asks then)."""
    return contextlib.nullcontext(), emulated_if(emulating())


class EmulatedBf16(TorchFunctionMode):
    """Within it, the matrix products torch would compute in bf16 on the CPU are computed by its float32
    kernels with bf16 rounding (the module docstring); everything else runs as it would."""

    def __enter__(self):
        _entered.depth = getattr(_entered, "depth", 0) + 1
        return super().__enter__()

    def __exit__(self, *exc):
        _entered.depth -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # every torch call of a training forward comes through here: only products pay for more than a lookup
        kwargs = kwargs or {}
        if func in PRODUCTS and _runs_in_bf16(func, args, kwargs):
            return emulated(func, args, dict(kwargs))
        return func(*args, **kwargs)
