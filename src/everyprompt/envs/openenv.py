"""OpenEnv environment servers (`env.name=openenv`): an episode is one session of a server that speaks
OpenEnv's protocol (a WebSocket per session: `reset`, then a `step` per model turn, typed actions and
observations as JSON), given by URL or started here from an app module (docs/environments.md).

Per episode: a session opened with openenv-core's own client (`GenericEnvClient`), `reset` with the
options' fixed keyword arguments and the data row's `row_fields`, its observation the first user message
(or the row's prompt, or both); each model turn sent as the action's `action_field`, the observation
answering it fed as the next user message, its reward the turn's; the session closed when the episode
ends. Every client of a process shares one event loop in a thread of its own.

What can go wrong, and what happens:
- a server that cannot be reached when the run starts: exit 2 naming `env.options.url` (or `app`);
- a server that answers a turn with an error (`ServerFailed`), too slowly (`ServerTimeout`: no answer
  within `timeout_s`, or the engine's `env.time_limit_s`) or drops the session (`ServerGone`, killed
  mid-episode): that episode ends with no reward and the reason counted in the step's metrics
  (`env/errors/<reason>`), the run goes on;
- a server that cannot be reached when an episode starts: an app server this process started that died
  is started again (up to `restarts` times in a run); otherwise (a server given by URL, a live one that
  refuses the session, a reset answered with an error) the run stops with `ServerUnreachable` (exit 1,
  the last checkpoint kept: `--resume` continues once it is back).

Local servers (`app: module:attribute`, an ASGI app as `openenv.core.env_server.create_app` makes) run
under uvicorn in a child process that dies with the run, even when the run is killed.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine

from everyprompt.envs.base import (
    EnvironmentSetupError,
    Message,
    StepResult,
    at_run_end,
    register_environment,
)
from everyprompt.errors import RunError
from everyprompt.processes import die_with_parent

INSTALL = "pip install 'everyprompt[openenv]'"
FIRST_MESSAGES = ("observation", "prompt", "both")
RESERVED = ("done", "reward", "metadata")  # an observation's fields that are not what it says


class ServerGone(RuntimeError):
    """The server dropped the session or refuses connections (killed, restarted, out of sessions)."""


class ServerFailed(RuntimeError):
    """The server answered with an error (the environment raised, the action did not validate)."""


class ServerTimeout(RuntimeError):
    """The server did not answer within the option `timeout_s`."""


class ServerUnreachable(RunError):
    """An episode cannot start: the server given by URL cannot be reached (the run stops)."""


def _client_class():
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError:
        raise EnvironmentSetupError(f"env.name=openenv needs openenv-core: {INSTALL}") from None
    return GenericEnvClient


class _Loop:
    """One asyncio loop in a daemon thread, for every OpenEnv client of the process."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def run(cls, coroutine: Coroutine, timeout: float | None = None):
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(
                    target=cls._loop.run_forever, name="everyprompt-openenv", daemon=True
                ).start()
        return asyncio.run_coroutine_threadsafe(coroutine, cls._loop).result(timeout)


def _get_json(url: str, timeout: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (http(s) only, checked)
        return json.loads(response.read().decode())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalServer:
    """An OpenEnv app served by uvicorn in a child process of this one (one per app and process)."""

    servers: dict[str, LocalServer] = {}

    def __init__(self, app: str, start_timeout_s: float):
        self.app, self.start_timeout_s = app, start_timeout_s
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.starts = 0  # in the current run: what `restarts` bounds (counted afresh once a run ends)

    @classmethod
    def of(cls, app: str, start_timeout_s: float) -> LocalServer:
        if app not in cls.servers:
            cls.servers[app] = cls(app, start_timeout_s)
        server = cls.servers[app]
        if server.process is None:
            server.start()
        return server

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start the server (again) and wait until it answers /health; EnvironmentSetupError naming the app
        when it exits or does not answer within `start_timeout_s`."""
        self.stop()
        port, parent = _free_port(), os.getpid()
        command = [sys.executable, "-m", "uvicorn", self.app, "--host", "127.0.0.1", "--port", str(port),
                   "--log-level", "warning"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
        self.process = subprocess.Popen(  # noqa: S603 (the interpreter itself, with uvicorn's own arguments)
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
            # its own session: a signal to the run's group (Ctrl-C, `timeout`) is the run's to act on, and
            # the server answers the step's last calls; the run stops it, or the kernel when the run dies
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(parent),  # noqa: PLW1509 (nothing else runs in the child)
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        self.starts += 1
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                said = self.process.stderr.read().decode(errors="replace").strip().splitlines()[-3:]
                self.process = None
                raise EnvironmentSetupError(
                    f"env.options.app={self.app}: its server exited when started ({' / '.join(said) or 'no output'})"
                )
            try:
                _get_json(f"{self.url}/health", 1.0)
                return
            except (OSError, ValueError):
                time.sleep(0.2)
        self.stop()
        raise EnvironmentSetupError(
            f"env.options.app={self.app}: its server did not answer within {self.start_timeout_s:g} s "
            "(env.options.start_timeout_s)"
        )

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None

    @classmethod
    def stop_all(cls) -> None:
        for server in cls.servers.values():
            server.stop()

    @classmethod
    def end_run(cls) -> None:
        """Stop every server; the next run in this process starts them afresh, with its own restarts."""
        cls.stop_all()
        for server in cls.servers.values():
            server.starts = 0


atexit.register(LocalServer.stop_all)  # (and the kernel ends them if this process is killed)
at_run_end(LocalServer.end_run)

_SCHEMAS: dict[str, dict] = {}


def _schema(url: str, key: str, timeout: float) -> dict:
    """The server's action and observation schemas (GET /schema, once per URL); EnvironmentSetupError
    naming `key` when nothing answers there."""
    if url not in _SCHEMAS:
        if not url.startswith(("http://", "https://")):
            raise EnvironmentSetupError(
                f"{key}={url}: expected an http:// or https:// URL of an OpenEnv server"
            )
        try:
            _SCHEMAS[url] = _get_json(f"{url.rstrip('/')}/schema", timeout)
        except (OSError, ValueError) as err:
            raise EnvironmentSetupError(
                f"{key}={url}: no OpenEnv server answers there ({getattr(err, 'reason', err)}); expected one "
                "serving /schema, /health and /ws"
            ) from None
    return _SCHEMAS[url]


@register_environment("openenv")
class OpenEnvEnvironment:
    """One episode in an OpenEnv server's session. Options (`env.options`):

    - `url`: the server (http://HOST:PORT), or `app`: `module:attribute` of an app to serve locally;
    - `action_field`: the action's field the model's turn goes into (default: its one required string
      field); `observation_field`: the observation's field shown to the model (default: its one string
      field, else the observation as JSON);
    - `first_message`: `observation` (the reset's, default), `prompt` (the data row's) or `both`;
    - `row_fields`: the data row's fields passed to `reset` as keyword arguments; `reset`: fixed ones;
    - `timeout_s` (30): longest wait for one answer; `connect_timeout_s` (10); `restarts` (3): times a
      local server is started again in a run; `start_timeout_s` (120); `stop`: strings that end a turn.
    """

    def __init__(
        self,
        url: str | None = None,
        app: str | None = None,
        action_field: str | None = None,
        observation_field: str | None = None,
        first_message: str = "observation",
        row_fields: list[str] | tuple[str, ...] = (),
        reset: dict | None = None,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        restarts: int = 3,
        start_timeout_s: float = 120.0,
        stop: list[str] | tuple[str, ...] = (),
    ):
        self._client_class = _client_class()
        if (url is None) == (app is None):
            raise EnvironmentSetupError(
                "env.options for env.name=openenv: give exactly one of url (a running server) and app "
                "(module:attribute of an OpenEnv app to serve here)"
            )
        if first_message not in FIRST_MESSAGES:
            raise EnvironmentSetupError(
                f"env.options.first_message={first_message!r}: expected one of {', '.join(FIRST_MESSAGES)}"
            )
        self.server = LocalServer.of(app, start_timeout_s) if app is not None else None
        self.key = "env.options.url" if url is not None else "env.options.app"
        self.url = url if url is not None else self.server.url
        schema = _schema(self.url, self.key, connect_timeout_s)
        self.action_field = action_field or self._only_field(
            schema.get("action", {}), "action_field", required=True
        )
        self.observation_field = observation_field
        self.first_message, self.row_fields, self.reset_kwargs = (
            first_message,
            tuple(row_fields),
            dict(reset or {}),
        )
        self.timeout_s, self.connect_timeout_s, self.restarts = timeout_s, connect_timeout_s, restarts
        self.stop = tuple(stop)
        self.client = None

    def _only_field(self, schema: dict, option: str, required: bool) -> str:
        properties = schema.get("properties", {})
        names = [n for n, p in properties.items() if n not in RESERVED and p.get("type") == "string"]
        if required:
            names = [n for n in names if n in schema.get("required", [])]
        if len(names) != 1:
            raise EnvironmentSetupError(
                f"env.options.{option}: the server at {self.url} ({schema.get('title', 'its action')}) has "
                f"{len(names)} string fields the model's turn could fill ({', '.join(names) or 'none'}); name one"
            )
        return names[0]

    # ------------------------------------------------------------ the episode
    def init(self, row: dict) -> list[Message]:
        missing = [f for f in self.row_fields if f not in row]
        if missing:
            raise EnvironmentSetupError(
                f"env.options.row_fields names {missing}, which a data row lacks (it has {sorted(row)})"
            )
        self.client = self._connect()
        kwargs = {**self.reset_kwargs, **{f: row[f] for f in self.row_fields}}
        try:
            result = self._call(self.client.reset(**kwargs))
        except (ServerGone, ServerFailed, ServerTimeout) as err:  # no prompt, so no episode: the run stops
            self.close()
            raise ServerUnreachable(
                f"{self.key}: an episode could not start, the OpenEnv server answered its reset with "
                f"{type(err).__name__}: {err} (reset arguments {sorted(kwargs)}); the run stopped"
            ) from None
        said = self._text(result.observation)
        prompt = str(row.get("prompt", ""))
        content = {"observation": said, "prompt": prompt, "both": f"{prompt}\n\n{said}".strip()}[
            self.first_message
        ]
        return [{"role": "user", "content": content}]

    def _connect(self):
        """A session of the server: started again first if it is this process's own server and died;
        ServerUnreachable when a server given by URL cannot be reached."""
        for attempt in range(2):
            if self.server is not None and not self.server.alive():
                if self.server.starts > self.restarts:
                    raise ServerUnreachable(
                        f"the OpenEnv server of {self.server.app} died {self.server.starts} times; "
                        f"env.options.restarts={self.restarts} are spent"
                    )
                self.server.start()
                self.url = self.server.url
            client = self._client_class(
                base_url=self.url, connect_timeout_s=self.connect_timeout_s, message_timeout_s=self.timeout_s
            )
            try:
                _Loop.run(client.connect())
                return client
            except ConnectionError as err:
                if self.server is None or self.server.alive() or attempt == 1:  # not a server that died
                    raise ServerUnreachable(
                        f"{self.key}={self.server.app if self.server else self.url}: an episode could not "
                        f"start, the OpenEnv server cannot be reached ({err}); the run stopped"
                    ) from None

    def _call(self, coroutine):
        """A request's answer; the failure as ServerGone, ServerFailed or ServerTimeout."""
        from websockets.exceptions import ConnectionClosed

        try:
            return _Loop.run(coroutine)
        except TimeoutError:
            raise ServerTimeout(f"no answer from {self.url} within {self.timeout_s:g} s") from None
        except (ConnectionClosed, ConnectionError, OSError) as err:
            raise ServerGone(f"the session with {self.url} was lost ({type(err).__name__}: {err})") from None
        except RuntimeError as err:
            raise ServerFailed(str(err)) from None

    def _text(self, observation: dict) -> str:
        if self.observation_field is not None:
            if self.observation_field not in observation:
                raise ServerFailed(
                    f"env.options.observation_field={self.observation_field}: the server's observation has "
                    f"no such field (it has {sorted(observation)})"
                )
            return str(observation[self.observation_field])
        shown = {k: v for k, v in observation.items() if k not in RESERVED}
        strings = [v for v in shown.values() if isinstance(v, str)]
        return strings[0] if len(shown) == 1 and strings else json.dumps(shown, sort_keys=True)

    def step(self, action: str) -> StepResult:
        if self.client is None:
            raise RuntimeError("step() before init()")
        result = self._call(self.client.step({self.action_field: action}))
        done = bool(result.done)
        said = [] if done else [{"role": "user", "content": self._text(result.observation)}]
        reward = None if result.reward is None else float(result.reward)
        return StepResult(observations=said, reward=reward, done=done)

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                _Loop.run(client.close(), timeout=self.connect_timeout_s)
            except Exception:  # noqa: BLE001 (a session of a server that is gone: nothing left to close)
                pass
