"""`everyprompt serve` as a user runs it: a server process over a tiny chat checkpoint, driven by the official
`openai` client and by raw HTTP. Checked: responses, log-probs (the trainer's), token ids, streaming,
continuous batching of 32 concurrent requests (each the same as alone), stop strings, the bounds and bad
requests (4xx with a message; the server keeps serving), a client that disconnects frees its row, the API
key, and SIGTERM ends the process with nothing left behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the openai client is in the dev extra")
pytest.importorskip("fastapi", reason="the server is the optional extra everyprompt[serve]")
import httpx  # noqa: E402
import torch  # noqa: E402

from everyprompt.cli import main  # noqa: E402
from everyprompt.config import load_config  # noqa: E402
from everyprompt.models import load_model_and_tokenizer  # noqa: E402
from everyprompt.models.io import load_pretrained  # noqa: E402
from everyprompt.processes import descendants, first_line, is_alive  # noqa: E402
from tests.conftest import TINY_OVERRIDES  # noqa: E402

MAX_TOKENS = 1000  # the server's bound on max_tokens
KEY = "s3cret"  # the server's API key (from the environment, as a deployment would set it)
AUTH = {"authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random-init tiny chat MoE (byte-level BPE with a chat template), saved as a user's checkpoint."""
    path = tmp_path_factory.mktemp("serve") / "tiny-chat"
    model, tokenizer = load_model_and_tokenizer(
        load_config(None, [*TINY_OVERRIDES, "model.preset=tiny-chat-moe"]).model, seed=0
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class Server:
    """`everyprompt serve` in a process of its own, on a free port."""

    def __init__(self, checkpoint: Path, *flags: str, env: dict | None = None):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "everyprompt.cli", "serve", str(checkpoint), "--port", "0", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        line = first_line(self.process, 180)  # the server says where it listens once the model is loaded
        assert "serving" in line, line + self.process.stderr.read()
        self.base = line.strip().rsplit(" ", 1)[-1]  # http://127.0.0.1:PORT/v1
        self.root = self.base.removesuffix("/v1")
        deadline = time.monotonic() + 60
        while True:  # the socket is bound before uvicorn starts: wait for the first answer
            try:
                httpx.get(f"{self.root}/health", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and self.process.poll() is None
                time.sleep(0.1)

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base, api_key=key, max_retries=0)

    def health(self) -> dict:
        return httpx.get(f"{self.root}/health").json()

    def stop(self) -> tuple[int, str, list[int]]:
        """SIGTERM; (return code, stderr, processes left behind 10 s later)."""
        children = descendants(self.process.pid)
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        deadline = time.monotonic() + 60
        while any(is_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.process.returncode, self.process.stderr.read(), [p for p in children if is_alive(p)]


@pytest.fixture(scope="module")
def server(checkpoint):
    """One server for the module (it starts in seconds, but they add up); the SIGTERM test, last, stops it."""
    running = Server(
        checkpoint,
        "--max-tokens",
        str(MAX_TOKENS),
        "--max-n",
        "4",
        "--batch-size",
        "8",
        env={"EVERYPROMPT_API_KEY": KEY},
    )
    yield running
    if running.process.poll() is None:
        running.stop()


@pytest.mark.long  # 14 s on 2 cores: `make test-long`
def test_a_chat_completion_has_the_models_logprobs_and_token_ids(server, checkpoint):
    response = server.client().chat.completions.create(
        model="tiny-chat",
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    extra = response.model_extra
    model, tokenizer = load_pretrained(checkpoint)
    prompt = tokenizer(
        tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    ).input_ids
    assert extra["prompt_token_ids"] == prompt
    tokens = choice.model_extra["token_ids"]
    assert response.usage.prompt_tokens == len(prompt) and response.usage.completion_tokens == len(tokens)
    assert choice.message.content == tokenizer.decode(tokens, skip_special_tokens=True)
    assert choice.finish_reason in ("stop", "length") and len(tokens) <= 12
    # the log-probs are the model's own: a forward over prompt + completion gives them
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    served = [entry.logprob for entry in choice.logprobs.content]
    assert served == pytest.approx(expected.tolist(), abs=1e-4)
    assert [entry.token for entry in choice.logprobs.content] == [tokenizer.decode([t]) for t in tokens]
    assert server.client().models.list().data[0].id == "tiny-chat"


def test_a_stream_writes_the_same_text_as_the_whole_response(server):
    client = server.client()
    whole = client.chat.completions.create(model="m", messages=CHAT, max_tokens=30, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=CHAT,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.long  # 13 s on 2 cores: `make test-long`
def test_seeded_samples_repeat_and_n_choices_differ(server):
    client = server.client()

    def ask():
        return client.completions.create(
            model="m", prompt="12+30=", max_tokens=16, n=3, temperature=1.0, seed=7, logprobs=0
        )

    first, again = ask(), ask()
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # each choice its own noise
    assert all(len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) for c in first.choices)


def test_32_concurrent_requests_are_batched_and_each_is_what_it_is_alone(server):
    prompts = [f"{a}+{a * 3}=" for a in range(32)]
    alone = [
        server.client().completions.create(model="m", prompt=p, max_tokens=24, temperature=0).choices[0].text
        for p in prompts[:4]
    ]

    async def together():
        client = openai.AsyncOpenAI(base_url=server.base, api_key=KEY, max_retries=0)
        calls = [
            client.completions.create(model="m", prompt=p, max_tokens=24, temperature=0.8, seed=i)
            for i, p in enumerate(prompts)
        ]
        greedy = [
            client.completions.create(model="m", prompt=p, max_tokens=24, temperature=0) for p in prompts[:4]
        ]
        return await asyncio.gather(*calls, *greedy)

    before = server.health()["sampled_tokens"]
    answers = asyncio.run(together())
    assert len(answers) == 36 and all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
    assert [a.choices[0].text for a in answers[32:]] == alone  # greedy in a busy batch == alone
    # seeded samples do not depend on the batch either: ask a few again, one at a time
    for i in (0, 17, 31):
        single = server.client().completions.create(
            model="m", prompt=prompts[i], max_tokens=24, temperature=0.8, seed=i
        )
        assert single.choices[0].text == answers[i].choices[0].text
    assert server.health()["sampled_tokens"] > before


def test_a_stop_string_ends_the_choice_before_it(server):
    client = server.client()
    free = client.completions.create(model="m", prompt="7+8=", max_tokens=30, temperature=0).choices[0].text
    stop = free[10:12]
    assert len(free) > 12 and stop
    cut = client.completions.create(model="m", prompt="7+8=", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == free[: free.index(stop)] and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ("{not json", 400, "not valid JSON"),
        (
            {"prompt": "1+1=", "max_tokens": MAX_TOKENS + 1},
            400,
            f"max_tokens={MAX_TOKENS + 1}; at most {MAX_TOKENS}",
        ),
        ({"prompt": "1+1=", "n": 5}, 400, "n=5; at most 4"),
        ({"prompt": "1" * 5000}, 400, "tokens; at most 1024"),
        ({"prompt": [1, 2, 10**9]}, 400, "prompt token ids must be in"),
        ({"prompt": "1+1=", "temperature": -1}, 400, "temperature"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "1+1=", "logprobs": 5}, 400, "the sampled token's log-prob only"),
        ({"prompt": "x" * (2 << 20)}, 413, "at most 1048576"),
    ],
)
def test_a_bad_request_is_a_4xx_with_a_message_and_the_server_goes_on(server, body, status, says):
    data = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(
        f"{server.base}/completions",
        content=data,
        headers={"content-type": "application/json", **AUTH},
        timeout=30,
    )
    assert response.status_code == status, response.text
    assert says in response.json()["error"]["message"]
    ok = server.client().completions.create(model="m", prompt="1+1=", max_tokens=4)
    assert ok.choices[0].text is not None


def test_a_client_that_disconnects_frees_its_row(server):
    cap = 300
    body = {"prompt": "37+48=", "max_tokens": cap, "temperature": 0}
    uncut = httpx.post(f"{server.base}/completions", json=body, headers=AUTH, timeout=120).json()
    assert uncut["choices"][0]["finish_reason"] == "length"  # greedy here runs to the cap when let
    before = server.health()["sampled_tokens"]
    with httpx.stream(
        "POST", f"{server.base}/completions", json={**body, "stream": True}, headers=AUTH, timeout=60
    ) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then the client goes away
    deadline = time.monotonic() + 120
    while server.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    health = server.health()
    assert health["running"] == 0 and health["waiting"] == 0
    assert health["sampled_tokens"] - before < cap  # freed before its cap


def test_the_api_key_is_required_on_every_route_but_health(server):
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").completions.create(model="m", prompt="1+1=", max_tokens=2)
    bare = httpx.post(f"{server.base}/completions", json={"prompt": "1+1=", "max_tokens": 2}, timeout=30)
    assert bare.status_code == 401 and "Authorization: Bearer KEY" in bare.json()["error"]["message"]
    assert httpx.get(f"{server.base}/models", timeout=30).status_code == 401
    ok = server.client(KEY).completions.create(model="m", prompt="1+1=", max_tokens=2)
    assert ok.usage.completion_tokens >= 1 and server.health()["status"] == "ok"


def test_listening_beyond_this_machine_without_a_key_is_refused(checkpoint, capsys, monkeypatch):
    monkeypatch.delenv("EVERYPROMPT_API_KEY", raising=False)
    assert main(["serve", str(checkpoint), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0 would let other machines use the model: set an API key" in err


def test_serve_without_its_extra_says_what_to_install(checkpoint, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["serve", str(checkpoint)]) == 2
    assert "everyprompt serve needs uvicorn: pip install 'everyprompt[serve]'" in capsys.readouterr().err


def test_sigterm_ends_the_server_and_leaves_nothing_behind(server):
    """Last in the module: it stops the module's server."""
    code, err, left = server.stop()
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM) and "Traceback" not in err, err
    assert not left
