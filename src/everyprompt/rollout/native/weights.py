"""The native engine's weights: a checkpoint's state dict laid out for decoding, one `Layer` per decoder
layer, each projection stored as the right operand of `x @ w` (fp8: as `FP8Weight`, per-output-channel
scales, dequantised once per generate call)."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace

import torch

from everyprompt.rollout.native.families import Family

E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


class FP8Weight:
    """A linear weight [..., out, in] kept in float8_e4m3fn with one float32 scale per output channel.

    `operand()` dequantises into the layout the engine multiplies by (weight-only FP8: activations stay
    in the engine's dtype). A stack of expert weights [E, out, in] has one scale per expert and channel.
    """

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.data, self.scale, self.dtype = data, scale, dtype

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> FP8Weight:
        weight = weight.detach().float()
        scale = (weight.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        return cls((weight / scale).to(torch.float8_e4m3fn), scale, dtype)

    def dequantize(self) -> torch.Tensor:
        return (self.data.float() * self.scale).to(self.dtype)

    def operand(self) -> torch.Tensor:
        """The right operand of `x @ w`: [in, out] (a stack [E, out, in] gives [E, in, out])."""
        return self.dequantize().transpose(-2, -1)

    def __getitem__(self, index) -> FP8Weight:
        return FP8Weight(self.data[index], self.scale[index], self.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ w` as an FP8 matrix product (`torch._scaled_mm`): x quantised to e4m3 with one scale per
        row (its absolute maximum / 448, computed now), the weight with its per-channel scales, products
        accumulated in float32 and written in bfloat16. A 2-D weight whose sides are not multiples of 16
        (the kernel's tiles) is multiplied dequantised instead."""
        if self.data.dim() != 2 or self.data.shape[0] % 16 or self.data.shape[1] % 16:
            return x @ self.operand()
        rows = x.reshape(-1, x.shape[-1]).float()
        x_scale = (rows.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        quantized = (rows / x_scale).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(
            quantized,
            self.data.t(),  # [in, out], column-major as the kernel wants its second operand
            scale_a=x_scale,
            scale_b=self.scale.reshape(1, -1),
            out_dtype=torch.bfloat16,
        )
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


Projection = torch.Tensor | FP8Weight


def linear(x: torch.Tensor, w: Projection) -> torch.Tensor:
    """`x @ w` for a projection: a plain operand, or an FP8Weight kept for FP8 matmuls."""
    return w.matmul(x) if isinstance(w, FP8Weight) else x @ w


def fp8_matmuls(device: torch.device) -> bool:
    """Whether fp8 rollouts on `device` multiply in FP8 (`FP8Weight.matmul`): CUDA devices of compute
    capability 9.0 or more (Hopper; per-row scales need it). Elsewhere FP8 is weight-only: the weights are
    dequantised once per generate call and multiplied in the engine's dtype (the reference path)."""
    if device.type != "cuda" or not torch.cuda.is_available():  # a fake CUDA device (tests) has none
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


@dataclass
class Layer:
    """One decoder layer's weights; `attention` is the attention variant's own (see attention.py)."""

    attention: object  # GroupedWeights | LatentWeights
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    router: torch.Tensor | None = None  # [H, E]
    router_bias: torch.Tensor | None = None  # [E] float32: DeepSeek-V3's score-correction bias (choice only)
    experts: tuple[Projection, Projection] | None = None  # gate_up [E, H, 2I], down [E, I, H]
    mlp: tuple[Projection, Projection] | None = None  # dense layers: gate_up [H, 2I], down [I, H]
    shared: tuple[Projection, Projection] | None = None  # shared expert (Qwen2-MoE, DeepSeek-V3), as `mlp`
    shared_gate: torch.Tensor | None = None  # [H, 1]: Qwen2-MoE's sigmoid gate on the shared expert

    def dequantized(self, keep_matmuls: bool = False) -> Layer:
        """This layer with every FP8Weight replaced by its dequantised operand (itself when none is):
        a generate call takes it once, so decode steps multiply plain tensors. `keep_matmuls`: the
        grouped-query attention's and the dense or shared SwiGLU's projections stay FP8Weights, for FP8
        matmuls (`linear`); routed experts (batched matmuls) and latent attention (absorbed forms) are
        dequantised either way."""
        if not self.quantized:
            return self
        if not keep_matmuls:
            return _dequantized(self)
        attention = self.attention if hasattr(self.attention, "qkv") else _dequantized(self.attention)
        return replace(self, attention=attention, experts=_dequantized(self.experts))

    @property
    def quantized(self) -> bool:
        return any(isinstance(value, FP8Weight) for value in vars(self.attention).values())


def _dequantized(value):
    if isinstance(value, FP8Weight):
        return value.operand()
    if isinstance(value, tuple):
        return tuple(map(_dequantized, value))
    if is_dataclass(value):
        return replace(value, **{f.name: _dequantized(getattr(value, f.name)) for f in fields(value)})
    return value


def copy_into(held, new) -> bool:
    """Copy the tensors of `new` into those of `held`, two structures of the same shape (tensors,
    FP8Weights, tuples, lists, dataclasses, None): the weights keep their storage addresses. Copies
    nothing and returns False where any tensor's shape, dtype or device, or the structure, differs."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    if not _pair(held, new, pairs):
        return False
    with torch.inference_mode():  # a generate call's dequantised copies are inference tensors
        for target, source in pairs:
            target.copy_(source)
    return True


def _pair(held, new, pairs: list) -> bool:
    if isinstance(held, torch.Tensor) or isinstance(new, torch.Tensor):
        same = (
            isinstance(held, torch.Tensor)
            and isinstance(new, torch.Tensor)
            and held.shape == new.shape
            and held.dtype == new.dtype
            and held.device == new.device
        )
        if same:
            pairs.append((held, new))
        return same
    if isinstance(held, FP8Weight):
        return isinstance(new, FP8Weight) and all(
            _pair(getattr(held, name), getattr(new, name), pairs) for name in ("data", "scale")
        )
    if isinstance(held, (tuple, list)):
        return (
            type(held) is type(new)
            and len(held) == len(new)
            and all(_pair(a, b, pairs) for a, b in zip(held, new))
        )
    if is_dataclass(held):
        return type(held) is type(new) and all(
            _pair(getattr(held, f.name), getattr(new, f.name), pairs) for f in fields(held)
        )
    return held == new


class StateDict:
    """Reads a transformers state dict into the engine's layout at `dtype` on `device` (`fp8`: projections
    quantised). The weights may come from anywhere (the learner's GPU, host memory after a transfer):
    each is moved to `device` first, and the reordering and quantising happen there."""

    def __init__(
        self,
        state_dict: dict[str, torch.Tensor],
        dtype: torch.dtype,
        fp8: bool,
        device: torch.device | str = "cpu",
    ):
        self.state, self.dtype, self.fp8, self.device = state_dict, dtype, fp8, torch.device(device)
        # each weight read so far -> the dtype it is kept in when that is a plain cast of it (None where
        # its value is computed from the weight as sent: fp8's quantised projections)
        self.kept: dict[str, torch.dtype | None] = {}

    def _keep(self, name: str, dtype: torch.dtype | None) -> None:
        # a weight read two ways (none is today) goes as sent
        self.kept[name] = dtype if self.kept.get(name, dtype) == dtype else None

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def get(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise KeyError(f"weight {name!r} missing from the state dict given to load_weights")
        return self.state[name].detach().to(self.device)

    @staticmethod
    def _owned(value: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """`value`, made from `source` (a weight as `get` read it), in storage of its own: the engine never
        holds memory of the weights it is given (a learner's parameter it would follow between syncs, a
        sync's read-only bucket in the object store), which a transpose that moves nothing (a [1, H]
        weight) would."""
        if (
            value.device == source.device
            and value.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
        ):
            return value.clone()
        return value

    def plain(self, name: str) -> torch.Tensor:
        self._keep(name, self.dtype)
        return self.get(name).to(self.dtype, copy=True)

    def float32(self, name: str) -> torch.Tensor:
        """A weight kept in float32 whatever the engine's dtype (DeepSeek-V3's routing bias)."""
        self._keep(name, torch.float32)
        return self.get(name).to(torch.float32, copy=True)

    def operand(self, name: str) -> torch.Tensor:
        """A weight kept in full precision (embeddings' transposes, routers, the LM head) as `x @ w`."""
        self._keep(name, self.dtype)
        weight = self.get(name)
        return self._owned(weight.to(self.dtype).T.contiguous(), weight)

    def projection(self, *names: str, rows: torch.Tensor | None = None) -> Projection:
        """Linear weights [out, in] stacked along `out` (fp8: quantised per output channel, so a fused
        projection has the scales its parts would have alone), as a right operand; `rows` reorders the
        output channels."""
        for name in names:
            self._keep(name, None if self.fp8 else self.dtype)
        weight = torch.cat([self.get(n) for n in names]) if len(names) > 1 else self.get(names[0])
        if rows is not None:
            weight = weight[rows.to(self.device)]
        if self.fp8:
            return FP8Weight.quantize(weight, self.dtype)
        return self._owned(weight.to(self.dtype).T.contiguous(), weight)

    def stacked(self, name: str) -> Projection:
        """Expert weights, checkpoint layout [E, out, in], multiplied as [E, in, out] (fp8: one scale per
        expert and output channel)."""
        self._keep(name, None if self.fp8 else self.dtype)
        weight = self.get(name)
        if self.fp8:
            return FP8Weight.quantize(weight, self.dtype)
        return self._owned(weight.to(self.dtype).transpose(1, 2).contiguous(), weight)

    def bias(self, *names: str, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        present = [n in self.state for n in names]
        if not any(present):
            return None
        if not all(present):
            raise KeyError(f"biases {', '.join(n for n, p in zip(names, present) if not p)} missing")
        bias = torch.cat([self.plain(n) for n in names])
        return bias if rows is None else bias[rows.to(self.device)]

    def swiglu(self, prefix: str) -> tuple[Projection, Projection]:
        return (
            self.projection(prefix + "gate_proj.weight", prefix + "up_proj.weight"),
            self.projection(prefix + "down_proj.weight"),
        )


def read_layer(weights: StateDict, family: Family, attention, index: int) -> Layer:
    """Decoder layer `index` of a checkpoint of `family`, its attention read by `attention` (an
    attention variant of attention.py)."""
    p = f"model.layers.{index}."
    layer = Layer(
        attention=attention.read(weights, p + "self_attn."),
        input_norm=weights.plain(p + "input_layernorm.weight"),
        post_norm=weights.plain(p + "post_attention_layernorm.weight"),
    )
    if p + "mlp.gate.weight" not in weights:
        layer.mlp = weights.swiglu(p + "mlp.")
        return layer
    layer.router = weights.operand(p + "mlp.gate.weight")
    if p + "mlp.gate.e_score_correction_bias" in weights:
        layer.router_bias = weights.float32(p + "mlp.gate.e_score_correction_bias")
    layer.experts = (
        weights.stacked(p + "mlp.experts.gate_up_proj"),
        weights.stacked(p + "mlp.experts.down_proj"),
    )
    if family.shared_expert == "gated":
        layer.shared = weights.swiglu(p + "mlp.shared_expert.")
        layer.shared_gate = weights.operand(p + "mlp.shared_expert_gate.weight")
    elif family.shared_expert == "plain":
        layer.shared = weights.swiglu(p + "mlp.shared_experts.")
    return layer
