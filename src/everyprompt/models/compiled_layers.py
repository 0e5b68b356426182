"""The learner's decoder layers through torch.compile (`model.kernels=compiled`).

A small model's learner on a GPU is bound by the host: an H200 computed 86 ms of a 0.95 s SmolLM2 update
(docs/gpu-runs.md), the rest was launching several thousand kernels one operator at a time. Compiled, a decoder
layer's elementwise work (RMSNorm with its float32 casts, rotary, SiLU times up, the residual adds) runs as
a few fused kernels forward and backward, and the matrix products stay the vendor library's. On this
project's 2-core CPU (SmolLM2, configs/smollm2.yaml's update of 64 sequences, bf16 products emulated;
bench/results/learner_compiled_cpu/): the same four batches took 12.8-19.4 s compiled against 15.8-21.5 s
eager, 8-27% less each; the first two updates compile (a graph without a mask, then one with). On a GPU not
measured yet: the learner profile's `compiled` variant (bench/learner/learner_profile.py) is for a lent one to say.

Each decoder layer (transformers' `GradientCheckpointingLayer`) is compiled in place, as `nn.Module.compile`
does it (its parameters and state-dict keys unchanged, so checkpoints and weight syncs see the same names),
with dynamic shapes, so that a packed micro-batch's new width does not compile again; the layers share their
graphs (two for a dense model's training passes: rows of one sequence, rows of several). A layer holding an MoE router compiles its other parts only (attention, norms): its router is
replayed by hooks (models/replay.py) and its experts have data-dependent shapes, both eager.

Where the compiler fails at a layer's first call (a missing C++ compiler or Triton, an operator it cannot
lower), every layer goes back to eager at once with one warning, and the learner's `actor/compiled_layers`
metric (the layers running compiled) says 0 from then on: the run goes on, its numbers unchanged.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable

import torch
from torch import nn

from everyprompt.errors import in_one_line
from everyprompt.models.kernels import KernelsError, register_kernels
from everyprompt.models.replay import find_routers

log = logging.getLogger(__name__)

# decoder layer -> the CompiledLayers it belongs to (by layer: a LoRA policy wraps the model, not its layers)
_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class CompiledLayers:
    """The compiled parts of one model's decoder layers: `count` of them run compiled until one fails."""

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts
        self.failed: str | None = None
        self.proven = False  # a compiled call has returned
        for part in parts:
            part._compiled_call_impl = CompiledCall(self, part, _compiled(part._call_impl))

    @property
    def count(self) -> int:
        return 0 if self.failed else len(self.parts)

    def eager(self, why: str) -> None:
        """Every part back to eager, for good (`count` 0)."""
        self.failed = why
        for part in self.parts:
            part._compiled_call_impl = None

    def give_up(self, err: Exception) -> None:
        self.eager(in_one_line(err))
        log.warning(
            "model.kernels=compiled: compiling the learner's layers failed (%s); they run eagerly from now on "
            "(actor/compiled_layers 0)",
            self.failed,
        )


# the graphs one compiled part may hold (torch's default, 8, is too few: a run's passes differ in gradients on
# or off, rows with or without a mask, training or eval mode, LoRA's adapters on or off, one-row micro-batches;
# past the limit torch runs the part eagerly, saying so only in its log)
RECOMPILE_LIMIT = 64


def _compiled(function):
    """`function` through torch.compile with dynamic shapes and `RECOMPILE_LIMIT` graphs (a limit of its own
    where torch.compile takes one, else the process's raised to it)."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return torch.compile(function, dynamic=True, recompile_limit=RECOMPILE_LIMIT)
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # its older name
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    return torch.compile(function, dynamic=True)


class CompiledCall:
    """One part's call through its compiled graph (what `nn.Module` calls as `_compiled_call_impl`). It
    belongs to this part: a copy of the model (the KL reference, the LoRA merge copy: `copy.deepcopy`), or a
    pickled one, gets None in its place and runs eagerly on its own weights."""

    def __init__(self, layers: CompiledLayers, part: nn.Module, compiled):
        self.layers, self.part, self.compiled = layers, part, compiled

    def __reduce__(self):
        return _eager, ()

    def __call__(self, *args, **kwargs):
        layers = self.layers
        if layers.failed is not None:
            return self.part._call_impl(*args, **kwargs)
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as err:
            # the compiler's own failures (a later recompilation's too), or anything before a compiled call
            # has ever returned (a kernel that fails at its first launch): a layer is a function of its
            # inputs, so running it again eagerly changes nothing else
            if layers.proven and not isinstance(err, torch._dynamo.exc.TorchDynamoException):
                raise
            layers.give_up(err)
            return self.part._call_impl(*args, **kwargs)
        layers.proven = True
        return out


def _eager() -> None:
    """What a copied `CompiledCall` becomes: no compiled call (the copy's part runs eagerly)."""
    return None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (transformers' `GradientCheckpointingLayer`s), a LoRA policy's included."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def compiled_parts(layer: nn.Module) -> list[nn.Module]:
    """What of `layer` is compiled: the whole layer, or where it holds an MoE router its parts without one."""
    if not find_routers(layer):
        return [layer]
    return [child for child in layer.children() if not find_routers(child)]


def check_compiler(device: torch.device) -> None:
    """A KernelsError where torch's compiler cannot build a kernel for `device` (tried on a small
    function: the C++ compiler on the CPU, Triton on CUDA)."""
    try:
        probe = torch.compile(lambda x: torch.sin(x) * 2 + 1, dynamic=False)
        value = probe(torch.arange(4.0, device=device))
        expected = torch.sin(torch.arange(4.0)) * 2 + 1
        if not torch.allclose(value.cpu(), expected, atol=1e-5):
            raise RuntimeError(f"its probe computed {value.tolist()}, expected {expected.tolist()}")
    except Exception as err:  # noqa: BLE001 (any failure: the key named, the reason given)
        raise KernelsError(
            f"config key 'model.kernels': compiled needs torch.compile to build kernels for {device}, and it "
            f"could not ({in_one_line(err)}); model.kernels=torch runs without it"
        ) from None


def compile_layers(model: nn.Module) -> None:
    """Compile `model`'s decoder layers in place (see the module docstring)."""
    layers = decoder_layers(model)
    if not layers:
        raise KernelsError(
            f"config key 'model.kernels': compiled compiles transformers' decoder layers, and "
            f"{type(model).__name__} has none"
        )
    state = CompiledLayers([part for layer in layers for part in compiled_parts(layer)])
    for layer in layers:
        _STATES[layer] = state


def _states(model: nn.Module) -> list[CompiledLayers]:
    states = {id(state): state for layer in decoder_layers(model) if (state := _STATES.get(layer))}
    return list(states.values())


def compiled_layer_count(model: nn.Module) -> int | None:
    """How many parts of `model`'s layers run compiled (0 once compiling failed); None where not asked."""
    states = _states(model)
    return sum(state.count for state in states) if states else None


def compiled_metrics(model: nn.Module) -> Callable[[], dict[str, float]]:
    """What an update of `model` reports: `actor/compiled_layers` under `model.kernels=compiled`, nothing
    otherwise (the model's layers looked up once, here, not at every update)."""
    states = _states(model)
    if not states:
        return dict
    return lambda: {"actor/compiled_layers": float(sum(state.count for state in states))}


def eager_layers(model: nn.Module) -> None:
    """`model`'s layers eager again, for good (the learner profile's next variant)."""
    for state in _states(model):
        state.eager("made eager")


register_kernels("compiled", check_compiler, compile_layers)
