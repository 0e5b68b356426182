"""The driven run's intake (serve/intake.py): what it keeps on disk before acknowledging, what a resumed run
reads back, and what it refuses."""

from __future__ import annotations

import os

import pytest

from everyprompt.errors import InputError
from everyprompt.serve.intake import Intake, Rollouts, read_journal


def _rollouts(*ks: int) -> Rollouts:
    sample = {"prompt_token_ids": [1, 2], "token_ids": [3], "logprobs": [-0.5]}
    return Rollouts.model_validate(
        {"groups": [{"samples": [{**sample, "reward": float(k)}, {**sample, "reward": 0.0}]} for k in ks]}
    )


def _rewards(groups) -> list[float]:
    return [g.samples[0].reward for g in groups]


def _intake(journal) -> Intake:
    return Intake(group_size=2, vocab_size=10, max_tokens=4, journal=journal)


def test_groups_are_journaled_before_they_are_queued_and_a_resumed_intake_skips_the_taken(tmp_path):
    journal = tmp_path / "rollouts.jsonl"
    intake = _intake(journal)
    assert intake.add(_rollouts(1, 2)) is None and intake.add(_rollouts(3)) is None
    assert len(journal.read_text().splitlines()) == 2  # one line a request, on disk already
    assert _rewards(intake.take(2, 1.0, lambda: True)) == [1.0, 2.0] and intake.taken == 2
    intake.close()
    again = _intake(journal)  # the process was killed; a resumed run reads the journal back
    assert again.received == 3 and again.queued == 3
    again.resume(2)  # its checkpoint's steps took two
    assert _rewards(again.take(1, 1.0, lambda: True)) == [3.0]
    with pytest.raises(Exception, match="took 4 groups; the run's journal holds 3"):
        _intake(journal).resume(4)


def test_a_line_cut_short_was_never_acknowledged_and_is_cut_off_the_file(tmp_path):
    journal = tmp_path / "rollouts.jsonl"
    intake = _intake(journal)
    intake.add(_rollouts(1))
    intake.close()
    whole = journal.read_bytes()
    journal.write_bytes(whole + _rollouts(2).model_dump_json().encode()[:40])  # killed mid-write
    assert _rewards(read_journal(journal)) == [1.0] and journal.read_bytes() == whole
    again = _intake(journal)
    again.add(_rollouts(3))  # appended after the last whole line
    assert _rewards(read_journal(journal)) == [1.0, 3.0]


def test_a_bad_whole_line_is_an_error_naming_the_file_and_line(tmp_path):
    journal = tmp_path / "rollouts.jsonl"
    journal.write_text(_rollouts(1).model_dump_json() + "\n" + '{"groups": []}\n')
    with pytest.raises(InputError, match=r"rollouts.jsonl:2: not a line of acknowledged groups"):
        read_journal(journal)


def test_a_failed_write_acknowledges_nothing_and_leaves_no_part_of_it(tmp_path, monkeypatch):
    journal = tmp_path / "rollouts.jsonl"
    intake = _intake(journal)
    intake.add(_rollouts(1))
    before = journal.read_bytes()

    def full(_fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        intake.add(_rollouts(2))
    monkeypatch.undo()
    assert journal.read_bytes() == before and intake.queued == 1 and intake.received == 1
    intake.add(_rollouts(3))
    assert _rewards(read_journal(journal)) == [1.0, 3.0]


def test_a_group_the_learner_could_not_train_on_is_refused_and_not_journaled(tmp_path):
    journal = tmp_path / "rollouts.jsonl"
    intake = _intake(journal)
    bad = _rollouts(1)
    bad.groups[0].samples[0].token_ids = [11]  # outside the vocabulary
    assert "token ids must be in [0, 10)" in intake.add(bad)
    assert journal.read_text() == "" and intake.queued == 0


def test_the_endpoint_answers_a_failed_write_with_503_and_keeps_nothing(tmp_path, monkeypatch):
    """Over HTTP: a request whose groups cannot be written down is not acknowledged (the driver retries)."""
    from types import SimpleNamespace

    pytest.importorskip("fastapi", reason="the server is the optional extra everyprompt[serve]")
    from fastapi.testclient import TestClient

    from everyprompt.serve.app import create_app
    from everyprompt.serve.protocol import Limits

    intake = _intake(tmp_path / "rollouts.jsonl")
    server = SimpleNamespace(tokenizer=None, version=0, failure=None)
    client = TestClient(create_app(server, "policy", Limits(), intake=intake))  # no lifespan: no engine
    body = _rollouts(1).model_dump()
    assert client.post("/v1/rollouts", json=body).json()["accepted"] == 1

    def full(_fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    answer = client.post("/v1/rollouts", json=body)
    assert answer.status_code == 503 and "post them again" in answer.json()["error"]["message"]
    assert intake.received == 1 and len(read_journal(tmp_path / "rollouts.jsonl")) == 1
