"""The engine registry: an engine registers itself with `@register_engine(name, model_types=..., rank=...)`;
`build_engine` is the one place that turns a config's `rollout.engine` into an engine (`auto`: the
lowest-ranked engine that can run the model), and `resolve_engine` refuses a model the engine cannot run
when the model is loaded, naming the setting and the engines that could run it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from everyprompt.choices import AUTO_ENGINE, ENGINES, GRAPH_BUCKETS, decoding, engine_choices
from everyprompt.devices import resolve_device
from everyprompt.rollout.base import RolloutEngine, UnsupportedModelError, offers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    cls: type
    model_types: tuple[str, ...]  # the `model_type`s (transformers config) the engine runs; () = any
    rank: int  # `rollout.engine=auto` takes the lowest-ranked engine that can run the model


_ENGINES: dict[str, EngineSpec] = {}
AUTO = AUTO_ENGINE  # not an engine: the choice of the fastest registered engine that runs the model


def register_engine(
    name: str, *, model_types: tuple[str, ...] = (), rank: int = 100
) -> Callable[[type], type]:
    """Class decorator: register a RolloutEngine implementation as `rollout.engine=name`. An engine may
    define `check_config(model_config)` (a classmethod raising UnsupportedModelError that names the
    setting it does not implement); it runs when the model is loaded, before any training."""

    def decorate(cls: type) -> type:
        if name in _ENGINES or name == AUTO:
            raise ValueError(f"rollout engine {name!r} is already registered")
        _ENGINES[name] = EngineSpec(cls, tuple(model_types), rank)
        ENGINES.add(name)  # what the config accepts
        return cls

    return decorate


def registered_engines() -> list[str]:
    return sorted(_ENGINES)


def _spec(name: str) -> EngineSpec:
    if name not in _ENGINES:
        raise KeyError(f"unknown rollout engine {name!r}; valid: {', '.join(engine_choices())}")
    return _ENGINES[name]


def _refusal(name: str, model_config: Any, precision: str | None = None) -> str | None:
    """Why engine `name` cannot run a model of `model_config` (at `precision`, when given); None: it can."""
    spec = _spec(name)
    model_type = getattr(model_config, "model_type", None)
    if spec.model_types and model_type not in spec.model_types:
        return f"it runs model_type {', '.join(spec.model_types)}, not {model_type!r}"
    precisions = getattr(spec.cls, "PRECISIONS", None)
    if precision is not None and precisions is not None and precision not in precisions:
        return f"it runs rollout.precision {', '.join(precisions)}, not {precision}"
    check = getattr(spec.cls, "check_config", None)
    if check is not None:
        try:
            check(model_config)
        except UnsupportedModelError as err:
            return str(err)
    return None


def engines_for(model_config: Any, precision: str | None = None) -> list[str]:
    """The registered engines that can run a model of this config (at `precision`), fastest first."""
    names = sorted(_ENGINES, key=lambda n: (_ENGINES[n].rank, n))
    return [n for n in names if _refusal(n, model_config, precision) is None]


def resolve_engine(name: str, model_config: Any, precision: str | None = None) -> str:
    """The engine that runs this model (at `precision`, when given): `name` itself (UnsupportedModelError
    naming why it cannot, and the engines that could), or for `auto` the fastest engine that can."""
    if name == AUTO:
        able = engines_for(model_config, precision)
        if not able:
            model_type = getattr(model_config, "model_type", None)
            why = "; ".join(f"{n}: {_refusal(n, model_config, precision)}" for n in registered_engines())
            raise UnsupportedModelError(
                f"no registered rollout engine can run this {model_type} model ({why})"
            )
        return able[0]
    why = _refusal(name, model_config, precision)
    if why is not None:
        model_type = getattr(model_config, "model_type", None)
        others = [n for n in engines_for(model_config, precision) if n != name]
        could = f"set rollout.engine={others[0]} (or auto)" if others else "no registered engine can"
        raise UnsupportedModelError(
            f"rollout.engine={name} cannot run this {model_type} model: {why}; {could}"
        )
    return name


def build_engine(config, model, tokenizer) -> RolloutEngine:
    """The engine a `RolloutConfig` names (`engine`, `batch_size`, `precision`, `compile`, `device`), over
    `model`'s weights."""
    return make_engine(
        config.engine,
        model,
        tokenizer,
        config.batch_size,
        config.precision,
        compile=config.compile,
        device=resolve_device(config.device, "rollout.device"),
        cuda_graphs=config.cuda_graphs,
        graph_buckets=config.graph_buckets,
    )


def make_engine(
    name: str,
    model,
    tokenizer,
    batch_size: int,
    precision: str = "fp32",
    compile: str = "off",
    device: torch.device | str = "cpu",
    cuda_graphs: str = "auto",
    graph_buckets=GRAPH_BUCKETS,
) -> RolloutEngine:
    """Engine `name` (or `auto`'s choice) over `model`'s weights, on `device`; UnsupportedModelError if it
    cannot run the model there. Each setting goes to the engines that offer it (`offers`): `compile` to
    those that compile their decode step (the others run eager under `auto` and refuse `on`),
    `cuda_graphs` and `graph_buckets` to those that capture it (the others refuse `on` and `static`, as
    does a device that is not CUDA), `device` to those that place themselves (the others run on the CPU
    and refuse any other device)."""
    chosen = resolve_engine(name, model.config, precision)
    if name == AUTO:
        log.info("rollout.engine=auto runs %s with the %s engine", model.config.model_type, chosen)
    cls = _spec(chosen).cls
    options = {}
    device = torch.device(device)
    if offers(cls, "device"):
        options["device"] = device
    elif device.type != "cpu":
        raise UnsupportedModelError(
            f"rollout.device={device}: the {chosen} engine runs on the CPU only (it does not offer "
            "`device`); use the native or hf engine, or rollout.device=cpu"
        )
    if offers(cls, "compile"):
        options["compile"] = compile
    elif compile == "on":
        raise UnsupportedModelError(
            f"rollout.compile=on compiles the native engine's decode step; the {chosen} engine does not "
            "(set rollout.compile=auto or off)"
        )
    if offers(cls, "cuda_graphs"):
        options.update(cuda_graphs=cuda_graphs, graph_buckets=graph_buckets)
    elif cuda_graphs in ("on", "static"):
        raise UnsupportedModelError(
            f"rollout.cuda_graphs={cuda_graphs} runs the native engine's static decode step; the {chosen} "
            "engine has none (set rollout.cuda_graphs=auto or off)"
        )
    try:
        decoding(compile, cuda_graphs, device.type)  # settings that conflict on this device
    except ValueError as err:
        raise UnsupportedModelError(f"{err} (the engine runs on {device})") from None
    return cls.from_model(model, tokenizer, batch_size=batch_size, precision=precision, **options)
