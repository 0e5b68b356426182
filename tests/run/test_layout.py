"""The run directory's one owner: its names and finders (run/layout.py) and where a run starts
(pipeline/resume.py), on directories made by hand."""

from __future__ import annotations

import logging

import pytest

from everyprompt.pipeline.resume import (
    SFTStart,
    latest_complete_checkpoint,
    resolve_checkpoint,
    rl_start,
    sft_start,
)
from everyprompt.run.layout import RunLayout, SweepLayout, find_checkpoint, numbered, series
from everyprompt.trainer.checkpoint import CheckpointError, _write_manifest


def _checkpoint(path, complete: bool = True):
    """A checkpoint directory with one file; complete: with its manifest (it verifies)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    if complete:
        _write_manifest(path)
    return path


def test_numbered_checkpoints_sort_by_their_number_and_keep_their_series(tmp_path):
    layout = RunLayout(tmp_path)
    for step in (10, 9, 2):
        layout.step_checkpoint(step).mkdir(parents=True)
    layout.sft_step_checkpoint(3).mkdir()
    layout.sft_checkpoint.mkdir()
    (layout.checkpoints / "step_x").mkdir()  # not a number: not a checkpoint of the series
    assert [p.name for p in layout.step_checkpoints()] == ["step_2", "step_9", "step_10"]  # 10 after 9
    assert [p.name for p in layout.sft_step_checkpoints()] == ["sft_step_3"]
    assert series(layout.step_checkpoint(9)) == layout.step_checkpoints()
    assert series(layout.sft_step_checkpoint(3)) == [layout.sft_step_checkpoint(3)]
    assert numbered(tmp_path / "nowhere", "step_") == []


def test_the_layout_names_the_files_of_a_run_and_a_sweep(tmp_path):
    layout = RunLayout(str(tmp_path))
    assert layout.config == tmp_path / "config.yaml" and layout.metrics == tmp_path / "metrics.jsonl"
    assert layout.sft.metrics == tmp_path / "sft" / "metrics.jsonl"
    assert layout.latest == tmp_path / "checkpoints" / "latest"
    assert layout.report_curves("rl") == tmp_path / "report" / "rl_curves.png"
    assert not layout.started()
    layout.config.write_text("seed: 0\n")
    assert layout.started()
    sweep = SweepLayout(tmp_path)
    assert sweep.cell("a,seed=0").config == tmp_path / "a,seed=0" / "config.yaml"
    assert not sweep.is_sweep()


def test_a_checkpoint_is_found_from_itself_a_run_directory_or_its_checkpoints(tmp_path):
    layout = RunLayout(tmp_path)
    step = _checkpoint(layout.step_checkpoint(1))
    layout.latest.symlink_to(step.name)
    for given in (step, tmp_path, layout.checkpoints):
        assert find_checkpoint(given) == step.resolve() == resolve_checkpoint(given)
    assert find_checkpoint(tmp_path / "nowhere") is None
    with pytest.raises(CheckpointError, match="nowhere: no checkpoint there"):
        resolve_checkpoint(tmp_path / "nowhere")


def test_rl_resumes_from_the_newest_checkpoint_that_verifies(tmp_path, caplog):
    layout = RunLayout(tmp_path)
    _checkpoint(layout.step_checkpoint(1))
    _checkpoint(layout.step_checkpoint(2), complete=False)  # cut short while it was written
    assert rl_start(layout, resume=False) is None
    with caplog.at_level(logging.WARNING, logger="everyprompt"):
        assert rl_start(layout, resume=True) == layout.step_checkpoint(1)
    assert "not resuming from step_2" in caplog.text


def test_a_resume_before_rl_checkpointed_restarts_rl_and_drops_its_pass_rates(tmp_path):
    layout = RunLayout(tmp_path)
    layout.pass_rates.write_text("rates of the attempt that was cut short")
    assert rl_start(layout, resume=True) is None
    assert not layout.pass_rates.exists()
    _checkpoint(layout.step_checkpoint(1), complete=False)
    with pytest.raises(CheckpointError, match="no complete checkpoint to resume from"):
        latest_complete_checkpoint(layout)


def test_sft_reuses_a_finished_stage_continues_a_cut_short_one_or_starts(tmp_path, caplog):
    layout = RunLayout(tmp_path)
    assert sft_start(layout, sft_steps=0) == SFTStart()
    assert sft_start(layout, sft_steps=10) == SFTStart()  # nothing there yet
    _checkpoint(layout.sft_step_checkpoint(4))
    assert sft_start(layout, sft_steps=10) == SFTStart(partial=layout.sft_step_checkpoint(4))
    _checkpoint(layout.sft_checkpoint, complete=False)  # damaged: named, and SFT continues instead
    with caplog.at_level(logging.WARNING, logger="everyprompt"):
        assert sft_start(layout, sft_steps=10) == SFTStart(partial=layout.sft_step_checkpoint(4))
    assert "the SFT checkpoint is damaged" in caplog.text
    _write_manifest(layout.sft_checkpoint)
    assert sft_start(layout, sft_steps=10) == SFTStart(finished=layout.sft_checkpoint)
