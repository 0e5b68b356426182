"""A run that can be trusted with hours of compute: resume equals an uninterrupted run, a damaged or
unsafe checkpoint is named and refused, a full or unwritable disk fails at once and keeps the previous
checkpoint, and a run whose updates stay non-finite stops naming its last checkpoint."""

import pytest
import torch
from safetensors import SafetensorError

from everyprompt.pipeline import Run, train
from everyprompt.pipeline.resume import resolve_checkpoint
from everyprompt.trainer.checkpoint import CheckpointError, load_trainer_state
from tests.conftest import tiny_config
from tests.trainer.test_rl import _parameters


@pytest.mark.long  # 6 s on 2 cores: `make test-long`
def test_resume_equals_an_uninterrupted_run(tmp_path):
    straight = train(tiny_config("rl.steps=4"), run_dir=tmp_path / "straight")
    first = train(tiny_config("rl.steps=2"), run_dir=tmp_path / "split")
    assert first.step == 2
    resumed = train(tiny_config("rl.steps=4"), run_dir=tmp_path / "split", resume=True)
    assert resumed.step == 4
    a, b = _parameters(straight.model), _parameters(resumed.model)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


def test_a_damaged_checkpoint_is_named_and_the_run_resumes_from_the_newest_complete_one(tmp_path, caplog):
    train(tiny_config("rl.steps=2"), run_dir=tmp_path)  # step_1 and step_2 (latest)
    state = resolve_checkpoint(tmp_path) / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:-100])  # truncated
    trainer = Run(tiny_config(), tmp_path).trainer(resume=True)
    assert trainer.step == 1
    assert "step_2/trainer_state.pt" in caplog.text and "truncated or altered" in caplog.text
    # the other one altered, same size: nothing complete is left
    weights = tmp_path / "checkpoints" / "step_1" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"no complete checkpoint to resume from.*model.safetensors: checksum"
    ):
        Run(tiny_config(), tmp_path).trainer(resume=True)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resolve_checkpoint(tmp_path / "nowhere")


FULL_DISK = {  # how a full disk reaches save_checkpoint: from the OS, and from safetensors' own writer
    "oserror": lambda: OSError(28, "No space left on device"),
    "safetensors": lambda: SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    ),
}


@pytest.mark.parametrize("source", sorted(FULL_DISK))
def test_an_unwritable_checkpoint_directory_fails_at_once_and_keeps_the_previous_one(
    tmp_path, monkeypatch, source
):
    import everyprompt.trainer.learner_side.learner as writer  # where an RL checkpoint's model is written
    from everyprompt.trainer.checkpoint import verify_checkpoint

    trainer = train(tiny_config("rl.steps=1"), run_dir=tmp_path)
    real_save = writer.save_pretrained

    def full_disk(model, tokenizer, path, merged=False):
        real_save(model, tokenizer, path, merged)
        raise FULL_DISK[source]()

    monkeypatch.setattr(writer, "save_pretrained", full_disk)
    trainer.step = 2
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*step_2: .*No space left on device"):
        trainer.save()
    assert resolve_checkpoint(tmp_path).name == "step_1"
    verify_checkpoint(resolve_checkpoint(tmp_path))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "sft", "step_1"]


def test_a_checkpoint_write_that_fails_otherwise_leaves_no_half_written_copy(tmp_path, monkeypatch):
    import everyprompt.trainer.learner_side.learner as writer  # where an RL checkpoint's model is written

    trainer = train(tiny_config("rl.steps=1"), run_dir=tmp_path)
    real_save = writer.save_pretrained

    def interrupted(model, tokenizer, path, merged=False):
        real_save(model, tokenizer, path, merged)
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "save_pretrained", interrupted)
    trainer.step = 2
    with pytest.raises(KeyboardInterrupt):
        trainer.save()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "sft", "step_1"]


def test_a_resume_tidies_what_a_write_killed_midway_left_and_puts_back_a_checkpoint_moved_aside(
    tmp_path, caplog
):
    import os
    import shutil
    import subprocess

    train(tiny_config("rl.steps=2"), run_dir=tmp_path)  # step_1 and step_2 (latest)
    checkpoints = tmp_path / "checkpoints"
    ended = subprocess.Popen(["true"])
    ended.wait()
    dead = ended.pid  # the writer, gone
    # killed while re-writing step_2 (a resumed run's final step), between the swap's two renames
    os.replace(checkpoints / "step_2", checkpoints / f".old-step_2-{dead}")
    shutil.copytree(checkpoints / f".old-step_2-{dead}", checkpoints / f".tmp-step_2-{dead}")
    (checkpoints / f".tmp-step_3-{dead}").mkdir()  # and a write cut short
    (checkpoints / f".tmp-step_3-{dead}" / "model.safetensors").write_bytes(b"half")
    (checkpoints / f".latest-{dead}").symlink_to("step_3")
    (checkpoints / f".tmp-step_9-{os.getpid()}").mkdir()  # a live process's write is left alone
    trainer = Run(tiny_config("rl.steps=3"), tmp_path).trainer(resume=True)
    trainer.close()
    assert trainer.step == 2  # from step_2, put back, not step_1
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        f".tmp-step_9-{os.getpid()}",
        "latest",
        "sft",
        "step_1",
        "step_2",
    ]
    assert "step_2: put back from .old-step_2" in caplog.text and f".tmp-step_3-{dead}" in caplog.text


def test_a_disk_too_full_for_the_next_checkpoint_is_warned_of_when_this_one_is_written(
    tmp_path, monkeypatch, caplog
):
    import collections
    import shutil

    trainer = train(tiny_config("rl.steps=1"), run_dir=tmp_path)
    written = resolve_checkpoint(tmp_path)  # the next one is as large: every file but the manifest
    size = sum(f.stat().st_size for f in written.rglob("*") if f.is_file() and f.name != "manifest.json")
    usage = collections.namedtuple("usage", "total used free")
    for free, warned in [(10 * size, False), (size - 1, True)]:
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: usage(0, 0, free))
        caplog.clear()
        trainer.step += 1
        with caplog.at_level("WARNING", logger="everyprompt.trainer.checkpoint"):
            trainer.save()
        assert ("the next checkpoint will not fit" in caplog.text) is warned, (free, caplog.text)
    assert f"step_{trainer.step} takes {size / 1e9:.2f} GB and only {(size - 1) / 1e9:.2f} GB" in caplog.text


def test_a_run_directory_that_cannot_be_written_is_named_at_once(tmp_path, capsys):
    from everyprompt.cli import main
    from tests.conftest import TINY_OVERRIDES

    (tmp_path / "file").write_text("not a directory")
    assert main(["train", *TINY_OVERRIDES, "--run-dir", str(tmp_path / "file" / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("everyprompt: ")
        and f"{tmp_path / 'file' / 'run'}: cannot write the run directory" in err
    )


def test_kl_reference_is_the_starting_policy_after_resume(tmp_path):
    options = ("rl.kl.estimator=k2", "rl.lr=1e-2", "rewards.function=tests.trainer.flaky_reward:parity")
    train(tiny_config("rl.steps=1", *options), run_dir=tmp_path)
    start = Run(tiny_config(), tmp_path).warm_started_model()[0]
    resumed = Run(tiny_config("rl.steps=2", *options), tmp_path).trainer(resume=True)
    torch.testing.assert_close(resumed.learner.reference.state_dict(), start.state_dict())
    moved = resumed.model.model.embed_tokens.weight
    assert not torch.allclose(moved, resumed.learner.reference.model.embed_tokens.weight)


class _Payload:
    """Pickles to a call that touches a file: what a malicious checkpoint would do on load."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_checkpoint_that_would_run_code_is_refused_unopened(tmp_path):
    train(tiny_config("rl.steps=1"), run_dir=tmp_path)
    marker = tmp_path / "pwned"
    state_file = resolve_checkpoint(tmp_path) / "trainer_state.pt"
    state = load_trainer_state(resolve_checkpoint(tmp_path))  # a real state loads with weights_only
    assert state["step"] == 1
    torch.save({**state, "extra": _Payload(str(marker))}, state_file)
    with pytest.raises(CheckpointError, match="trainer_state.pt: cannot be read"):
        load_trainer_state(resolve_checkpoint(tmp_path))
    assert not marker.exists()


def test_a_run_whose_updates_stay_non_finite_stops_and_names_its_last_checkpoint(
    tmp_path, monkeypatch, capsys
):
    from everyprompt.cli import main
    from everyprompt.trainer.learner_side.learner import Learner
    from tests.conftest import TINY_OVERRIDES

    real_optimize = Learner._optimize

    def poisoned(self, batch):  # from the third update on, every gradient is infinite
        if self.version >= 2 and not getattr(self, "_poisoned", False):
            self.model.lm_head.weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
            self._poisoned = True
        return real_optimize(self, batch)

    monkeypatch.setattr(Learner, "_optimize", poisoned)
    signal = "rewards.function=tests.trainer.flaky_reward:scattered"  # every step has something to update
    argv = [
        "train",
        *TINY_OVERRIDES,
        signal,
        "rl.steps=6",
        "rl.max_skipped_updates=2",
        "--run-dir",
        str(tmp_path),
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "2 updates in a row were skipped" in err and "Traceback" not in err
    assert f"last good state is {(tmp_path / 'checkpoints' / 'step_2').resolve()}" in err
