"""`everyprompt serve`: a checkpoint behind an OpenAI-compatible HTTP server (uvicorn), on the native engine.

It listens on 127.0.0.1 unless told otherwise and refuses another address without an API key. SIGTERM or
SIGINT stops it: uvicorn finishes the open responses, then the engine's thread is stopped and joined, so
nothing is left running."""

from __future__ import annotations

import ipaddress
import os
import socket

from everyprompt.errors import InputError
from everyprompt.serve.protocol import Limits

API_KEY_VARIABLE = "EVERYPROMPT_API_KEY"


class ServeError(InputError):
    """A serve setting that cannot be honoured (an address without a key, a model the engine cannot run)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_key_for(host: str, api_key: str | None) -> str | None:
    """The key requests must carry (`--api-key`, else $EVERYPROMPT_API_KEY); ServeError for an address
    beyond this machine without one."""
    key = api_key or os.environ.get(API_KEY_VARIABLE) or None
    if key is None and not is_loopback(host):
        raise ServeError(
            f"--host {host} would let other machines use the model: set an API key (--api-key KEY or "
            f"${API_KEY_VARIABLE}), or listen on 127.0.0.1"
        )
    return key


def listen(host: str, port: int, setting: str = "--port") -> tuple[socket.socket, str]:
    """A socket bound to `host:port` (0: any free port) and the base URL it serves (`.../v1`); ServeError
    naming `setting` if it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ServeError(f"{setting}={port}: cannot listen on {host} ({err.strerror or err})") from None
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    return sock, f"http://{shown}:{sock.getsockname()[1]}/v1"


def build(model_path: str, batch_size: int, precision: str, device: str, limits: Limits):
    """The model at `model_path` on the native engine, and the serving engine's thread over it."""
    from everyprompt.devices import resolve_device
    from everyprompt.models.io import load_pretrained
    from everyprompt.rollout.native import NativeEngine
    from everyprompt.serve.engine import ServingEngine

    model, tokenizer = load_pretrained(model_path)
    place = resolve_device(device, "--device")
    try:
        NativeEngine.check_config(model.config)
    except InputError as err:
        raise ServeError(f"{model_path}: {err}") from None
    engine = NativeEngine.from_model(model, tokenizer, batch_size, precision=precision, device=place)
    del model
    return ServingEngine(engine, tokenizer, limits.max_prompt_tokens, limits.max_tokens), tokenizer


def serve(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    limits: Limits | None = None,
    batch_size: int = 32,
    precision: str = "fp32",
    device: str = "auto",
    name: str | None = None,
) -> None:
    import uvicorn

    from everyprompt.serve.app import create_app

    limits = limits or Limits()
    key = api_key_for(host, api_key)
    serving, _tokenizer = build(model_path, batch_size, precision, device, limits)
    sock, url = listen(host, port)
    app = create_app(serving, name or os.path.basename(os.path.normpath(model_path)), limits, key)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10))
    print(f"everyprompt: serving {model_path} on {url}", flush=True)
    try:
        # the app's lifespan starts the engine's thread and, at shutdown, joins it; on SIGTERM / SIGINT
        # uvicorn finishes the open responses, then raises the signal again (exit 143 / 130)
        server.run(sockets=[sock])
    finally:
        serving.close()
        sock.close()
