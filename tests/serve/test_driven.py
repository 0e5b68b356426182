"""A run driven from outside (config `external`): a small driver written here generates through the run's
endpoint with the `openai` client, scores the samples itself and posts the groups; each step trains on the
groups posted and the endpoint then serves the new weights."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai", reason="the openai client is in the dev extra")
pytest.importorskip("fastapi", reason="the server is the optional extra everyprompt[serve]")
import httpx  # noqa: E402

from everyprompt.config import ConfigError  # noqa: E402
from everyprompt.pipeline import train  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402

GROUP = 4
PROBE = {"prompt": "12+30=", "max_tokens": 6, "temperature": 0, "logprobs": 0}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def score(text: str) -> float:
    """The driver's own reward: a signal that varies within a group."""
    return float(len(text) % 2)


def sample_group(client, base: str, question: str, seed: int) -> tuple[dict, list[float]]:
    answer = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": question}],
        n=GROUP,
        max_tokens=12,
        temperature=1.0,
        seed=seed,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    prompt = answer.model_extra["prompt_token_ids"]
    samples = []
    for choice in answer.choices:
        samples.append(
            {
                "prompt_token_ids": prompt,
                "token_ids": choice.model_extra["token_ids"],
                "logprobs": [entry.logprob for entry in choice.logprobs.content],
                "reward": score(choice.message.content),
                "finish_reason": choice.finish_reason,
            }
        )
    return {"samples": samples}, [s["reward"] for s in samples]


def test_an_outside_driver_samples_scores_and_the_run_trains_on_its_groups(tmp_path):
    port = free_port()
    config = tiny_config(
        "model.preset=tiny-chat-moe",
        "sft.steps=0",
        "external.enabled=true",
        f"external.port={port}",
        "external.wait_s=120",
        "rl.steps=2",
        "rl.prompts_per_step=2",
        f"rl.group_size={GROUP}",
        "rollout.max_new_tokens=16",
        "eval.every=0",
        "data.num_eval=2",
    )
    failure: list = []

    def run():
        try:
            train(config, run_dir=tmp_path / "run")
        except BaseException as err:  # noqa: BLE001 (reported by the test)
            failure.append(err)

    trainer = threading.Thread(target=run)
    trainer.start()
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 600  # a bound on a hang, far above the work
    while True:  # the run starts its endpoint once the model is loaded
        try:
            state = httpx.get(f"{base}/rollouts", timeout=5).json()
            break
        except httpx.TransportError:
            assert trainer.is_alive() and time.monotonic() < deadline, failure
            time.sleep(0.2)
    assert state["version"] == 0
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
    before = httpx.post(f"{base}/completions", json=PROBE, timeout=60).json()
    # a group the learner could not train on is refused, naming why
    bad, _ = sample_group(client, base, "What is 1 + 1?", seed=0)
    refused = httpx.post(f"{base}/rollouts", json={"groups": [{"samples": bad["samples"][:3]}]}, timeout=30)
    assert (
        refused.status_code == 400 and "3 samples; rl.group_size is 4" in refused.json()["error"]["message"]
    )
    posted: list[list[float]] = []
    for step in range(2):
        groups = []
        for number in range(2):
            group, rewards = sample_group(
                client, base, f"What is {step} + {number}?", seed=10 * step + number
            )
            groups.append(group)
            posted.append(rewards)
        accepted = httpx.post(f"{base}/rollouts", json={"groups": groups}, timeout=30).json()
        assert accepted["accepted"] == 2
        if step == 0:  # the next groups are sampled from the updated weights
            while httpx.get(f"{base}/rollouts", timeout=5).json()["version"] < 1:
                assert trainer.is_alive() and time.monotonic() < deadline + 120, failure
                time.sleep(0.1)
            after = httpx.post(f"{base}/completions", json=PROBE, timeout=60).json()
            # the endpoint serves the learner's new weights: the same greedy request's log-probs moved
            assert (
                after["choices"][0]["logprobs"]["token_logprobs"]
                != before["choices"][0]["logprobs"]["token_logprobs"]
            )
    trainer.join(300)
    assert not trainer.is_alive() and not failure, failure
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for step, line in enumerate(lines):  # each step trained on the rewards the driver gave its groups
        rewards = [r for group in posted[2 * step : 2 * step + 2] for r in group]
        assert line["reward/mean"] == pytest.approx(sum(rewards) / len(rewards))
        assert line["rollout/tokens"] > 0
    with pytest.raises(httpx.TransportError):  # the run closed its endpoint when it ended
        httpx.get(f"{base}/rollouts", timeout=2)


@pytest.mark.parametrize(
    "setting",
    [
        ("env.name=calculator",),
        ("rollout.partial=true",),
        ("zve.enabled=true",),
        ("cluster.backend=ray",),
        ("rl.teacher.by=task", "rl.teacher.models={math: a}"),  # the driver's groups carry no columns
    ],
)
def test_what_the_driver_does_is_refused_beside_external(setting):
    with pytest.raises(ConfigError, match=r"external.enabled: the driver samples, scores and picks"):
        tiny_config("model.preset=tiny-chat-moe", "external.enabled=true", *setting)


def _group(k: int) -> dict:
    """A scored group the driver made up: its rewards' mean is k / 4, so a step's mean names its groups."""
    rewards = [float(k), 0.0, 0.0, 0.0]
    sample = {"prompt_token_ids": [5, 6, 7], "token_ids": [8, 9, 10], "logprobs": [-1.0] * 3}
    return {"samples": [{**sample, "reward": r, "finish_reason": "length"} for r in rewards]}


def _start(arguments: list[str], log) -> subprocess.Popen:
    command = [sys.executable, "-m", "everyprompt.cli", "train", *arguments]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(condition, process: subprocess.Popen, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, f"the run ended while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.1)


def _serving(base: str) -> bool:
    try:
        return httpx.get(f"{base}/rollouts", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.long  # tens of seconds: `make test-long` (.ci/run runs it after `make test`)
def test_acknowledged_groups_survive_a_kill_and_are_trained_on_exactly_once(tmp_path):
    """Groups answered 200 are on disk before the answer: a run killed with SIGKILL right after, and
    resumed, trains on each of them once, in the order posted; the driver posts only what is new."""
    from tests.conftest import SYNCHRONOUS, TINY_OVERRIDES

    port, run_dir = free_port(), tmp_path / "run"
    base = f"http://127.0.0.1:{port}/v1"
    overrides = [
        *TINY_OVERRIDES,
        *SYNCHRONOUS,
        "sft.steps=0",
        "external.enabled=true",
        f"external.port={port}",
    ]
    overrides += ["external.wait_s=120", "rl.steps=3", "rl.prompts_per_step=2", f"rl.group_size={GROUP}"]
    overrides += ["rollout.max_new_tokens=16", "eval.every=0", "data.num_eval=2", "checkpoint.every=1"]
    with open(tmp_path / "first.log", "wb") as log:
        first = _start([*overrides, "--run-dir", str(run_dir)], log)
        try:
            _wait_for(lambda: _serving(base), first, "the endpoint")
            assert httpx.post(f"{base}/rollouts", json={"groups": [_group(1), _group(2)]}).status_code == 200
            _wait_for(lambda: (run_dir / "checkpoints" / "step_1").is_dir(), first, "step 1's checkpoint")
            answer = httpx.post(f"{base}/rollouts", json={"groups": [_group(3), _group(4), _group(5)]})
            assert answer.status_code == 200 and answer.json()["accepted"] == 3
        finally:
            os.killpg(first.pid, signal.SIGKILL)  # acknowledged, then killed: nothing after the answer runs
            first.wait(30)
    with open(tmp_path / "second.log", "wb") as log:
        second = _start(["--resume", str(run_dir)], log)
        try:
            _wait_for(lambda: _serving(base), second, "the resumed run's endpoint")
            state = httpx.get(f"{base}/rollouts", timeout=5).json()
            assert state["received"] == 5  # every acknowledged group is back, before the driver posts again
            assert httpx.post(f"{base}/rollouts", json={"groups": [_group(6)]}).status_code == 200
            assert second.wait(180) == 0, (tmp_path / "second.log").read_text()[-3000:]
        finally:
            if second.poll() is None:
                os.killpg(second.pid, signal.SIGKILL)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    # steps 1-3 trained on groups (1, 2), (3, 4), (5, 6): each step's mean reward is (k1 + k2) / 8
    assert [line["reward/mean"] for line in lines] == pytest.approx([3 / 8, 7 / 8, 11 / 8])
