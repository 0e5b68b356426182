"""OpenEnv environment servers (`env.name=openenv`), against a real server process of the tests' own
(tests/envs/openenv_app.py, written with openenv-core's server interface, served by uvicorn): episodes
through the protocol, a server that errs, answers too slowly or is killed mid-episode, RL on it with
the server started and ended by the run, a resumed run equal to an uninterrupted one, and bad set-ups
refused before any work."""

from __future__ import annotations

import json
import math
import sys

import pytest

pytest.importorskip("openenv.core", reason="openenv-core is the optional extra everyprompt[openenv]")

from everyprompt.envs import EnvironmentSetupError, make_environment  # noqa: E402
from everyprompt.envs.openenv import (  # noqa: E402
    LocalServer,
    ServerFailed,
    ServerGone,
    ServerTimeout,
    ServerUnreachable,
)
from everyprompt.processes import descendants  # noqa: E402
from tests.conftest import TINY_OVERRIDES, computed_figures, one_line_error, tiny_config  # noqa: E402

APP = "tests.envs.openenv_app:app"
pytestmark = pytest.mark.xdist_group("openenv")  # one server process for the module's tests


@pytest.fixture(scope="module")
def server():
    yield LocalServer.of(APP, 120.0)
    LocalServer.stop_all()


def episode(**options):
    return make_environment("openenv", app=APP, row_fields=["answer", "question"], **options)


@pytest.mark.long  # 13 s on 2 cores: `make test-long`
def test_an_episode_speaks_the_protocol_turn_by_turn(server):
    env = episode()
    assert env.action_field == "message"  # the action's one required string field, from /schema
    first = env.init({"prompt": "What is 5 + 7?", "answer": "12", "question": "What is 5 + 7?"})
    assert first == [{"role": "user", "content": "Answer with one number. What is 5 + 7?"}]
    wrong = env.step("it is 11")
    assert (wrong.reward, wrong.done, wrong.observations) == (
        0.0, False, [{"role": "user", "content": "Not quite; try once more."}]
    )  # fmt: skip
    right = env.step("12")
    assert (right.reward, right.done, right.observations) == (1.0, True, [])
    env.close()
    both = episode(first_message="both").init({"prompt": "Q?", "answer": "1", "question": ""})
    assert both == [{"role": "user", "content": "Q?\n\nAnswer with one number."}]


@pytest.mark.long  # 13 s on 2 cores: `make test-long`
def test_an_error_a_slow_answer_and_a_killed_server_end_the_episode_with_their_reason(server):
    env = episode()
    env.init({"answer": "1", "question": ""})
    with pytest.raises(ServerFailed, match="the environment was asked to fail"):
        env.step("RAISE")
    slow = episode(timeout_s=1.0)
    slow.init({"answer": "1", "question": ""})
    with pytest.raises(ServerTimeout, match="within 1 s"):
        slow.step("SLOW")
    cut = episode()
    cut.init({"answer": "1", "question": ""})
    starts = server.starts
    server.process.kill()  # killed mid-episode
    server.process.wait()
    with pytest.raises(ServerGone, match="was lost"):
        cut.step("1")
    again = episode()  # this process's own server is started again for the next episode
    assert again.init({"answer": "2", "question": ""})[0]["content"].startswith("Answer")
    assert server.starts == starts + 1 and again.step("2").reward == 1.0


@pytest.mark.long  # 26 s on 2 cores: `make test-long`
def test_each_run_has_its_own_restarts(server):
    """The restarts a run may spend (`env.options.restarts`) are counted per run: one that ended gives the
    next run in the same process (a sweep's, a notebook's) a full budget, and leaves no server behind."""
    from everyprompt.envs.base import end_of_run

    server.starts = 4  # a run that spent its restarts
    end_of_run()
    assert server.starts == 0 and not server.alive()
    env = episode(restarts=0)  # the next run: its first start is not a restart
    assert env.init({"answer": "3", "question": ""})[0]["content"].startswith("Answer")
    assert server.starts == 1 and server.alive()


@pytest.mark.long  # 13 s on 2 cores: `make test-long`
def test_a_server_given_by_url_that_is_gone_stops_the_run(server):
    env = make_environment("openenv", url=server.url, row_fields=["answer"])
    server.stop()
    with pytest.raises(ServerUnreachable, match="cannot be reached"):
        env.init({"answer": "1"})
    server.start()


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            "{url: 'http://127.0.0.1:9'}",
            "env.options.url=http://127.0.0.1:9: no OpenEnv server answers there",
        ),
        ("{url: 'localhost:9'}", "expected an http:// or https:// URL"),
        ("{}", "give exactly one of url"),
        ("{app: " + APP + ", first_message: question}", "env.options.first_message='question'"),
        ("{app: " + APP + ", port: 3}", "unexpected keyword argument 'port'"),
    ],
)
def test_bad_set_ups_exit_2_before_any_work(capsys, tmp_path, server, options, expected):
    argv = ["train", *TINY_OVERRIDES, "model.preset=tiny-chat-moe", "sft.steps=0", "env.name=openenv",
            f"env.options={options}", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    line = one_line_error(capsys, argv)
    assert expected in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_without_the_extra_the_error_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core.generic_client", None)
    with pytest.raises(EnvironmentSetupError, match=r"pip install 'everyprompt\[openenv\]'"):
        make_environment("openenv", app=APP)


def _rows(tmp_path, die: bool = False):
    rows = [{"prompt": f"What is {n} + 1?", "answer": str(n + 1), "mode": ""} for n in range(8)]
    if die:
        rows[3]["mode"] = "die"
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rl_config(rows, *extra):
    options = f"{{app: {APP}, row_fields: [answer, mode], first_message: prompt, stop: [' ']}}"  # short turns
    return tiny_config(
        "model.preset=tiny-chat-moe", "sft.steps=0", "env.name=openenv", f"env.options={options}",
        "env.max_turns=2", f"data.train_file={rows}", f"data.eval_file={rows}", "rl.group_size=2",
        "rollout.max_new_tokens=32", "eval.num_samples=0", *extra,
    )  # fmt: skip


@pytest.mark.long
def test_rl_on_an_openenv_server_that_is_killed_mid_episode_goes_on_and_leaves_no_process(
    tmp_path, monkeypatch
):
    """Every prompt is drawn over 4 steps; the one reset with mode=die ends the server at its first step,
    so the episodes in flight end with ServerGone, the next episodes start the server again, and the run
    ends with no server left."""
    import os

    from everyprompt.pipeline import train

    LocalServer.end_run()  # a run of its own: none of the restarts the tests above spent
    starts = []
    start = LocalServer.start
    monkeypatch.setattr(LocalServer, "start", lambda self: (starts.append(1), start(self))[1])
    config = _rl_config(
        _rows(tmp_path, die=True), "rl.steps=4", "rl.prompts_per_step=2", "checkpoint.every=0"
    )
    train(config, run_dir=tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4
    assert sum(line.get("env/errors/ServerGone", 0) for line in lines) >= 1
    assert sum(line.get("rollout/environment_tokens", 0) for line in lines) > 0  # observations were fed
    assert len(starts) >= 2 and not LocalServer.servers[APP].alive()  # started again after it died
    assert not descendants(os.getpid())  # the server and the reward workers ended with the run


@pytest.mark.long
def test_a_resumed_run_on_an_openenv_server_equals_an_uninterrupted_one(tmp_path):
    from everyprompt.pipeline import train

    rows = _rows(tmp_path)
    straight = train(_rl_config(rows, "rl.steps=4"), run_dir=tmp_path / "straight")
    train(_rl_config(rows, "rl.steps=2"), run_dir=tmp_path / "split")
    train(_rl_config(rows, "rl.steps=4"), run_dir=tmp_path / "split", resume=True)
    assert straight.step == 4

    def figures(run):  # a resumed run checks the engine against the trainer again on its first step
        return [{k: v for k, v in r.items() if not k.startswith("parity/")} for r in computed_figures(run)]

    # equal, each float to its last bits: which rows decode in one step depends on when the server answered
    # each episode, and a matmul's last bits on how many rows it has (a run without environments repeats
    # bit for bit: tests/trainer/test_rl.py)
    straight, split = figures(tmp_path / "straight"), figures(tmp_path / "split")
    assert [r.keys() for r in straight] == [r.keys() for r in split]
    for mine, theirs in zip(straight, split):
        for key, value in mine.items():
            assert math.isclose(value, theirs[key], rel_tol=1e-5, abs_tol=1e-9), (mine["step"], key)
    assert any(r["rollout/environment_tokens"] > 0 for r in straight)


def test_a_reset_the_server_refuses_stops_the_run_with_a_clear_error(server):
    env = make_environment("openenv", app=APP, reset={"question": "RAISE"})
    with pytest.raises(ServerUnreachable, match="answered its reset with ServerFailed"):
        env.init({})
