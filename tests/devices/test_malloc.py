"""The config's `malloc` (devices/malloc.py): which malloc a command runs on, the command started again
with a library preloaded, and the clear errors where it cannot be."""

import subprocess
import sys
import typing

import pytest

from everyprompt.cli import main
from everyprompt.config import Config
from everyprompt.devices import malloc
from everyprompt.devices.malloc import (
    MALLOCS,
    STARTED_FOR,
    installed,
    malloc_note,
    running_malloc,
    use_malloc,
    wanted_malloc,
)
from everyprompt.errors import InputError, RunError
from tests.conftest import TINY_OVERRIDES, computed_figures

TCMALLOC = pytest.mark.skipif(
    not installed("tcmalloc"), reason="tcmalloc is not installed (libtcmalloc-minimal4)"
)


def test_the_config_offers_the_registry_and_auto():
    choices = typing.get_args(Config.model_fields["malloc"].annotation)
    assert set(choices) == {"auto", *MALLOCS} and Config().malloc == "glibc"


def test_this_test_process_runs_on_glibc():
    assert running_malloc() == "glibc"
    assert use_malloc("glibc") == "glibc"  # nothing to do: no new process


def test_auto_takes_tcmalloc_where_installed_else_glibc(monkeypatch):
    monkeypatch.setattr(malloc, "installed", lambda name: True)
    assert wanted_malloc("auto") == "tcmalloc"
    monkeypatch.setattr(malloc, "installed", lambda name: name == "glibc")
    assert wanted_malloc("auto") == "glibc"


def test_a_named_malloc_not_installed_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(malloc, "installed", lambda name: name == "glibc")
    with pytest.raises(
        InputError, match=r"malloc: jemalloc: .*libjemalloc\.so\.2.*apt-get install libjemalloc2"
    ):
        wanted_malloc("jemalloc")
    with pytest.raises(InputError, match="'nope' is not one of auto, glibc, tcmalloc, jemalloc"):
        wanted_malloc("nope")


def test_the_cli_exits_2_for_a_malloc_not_installed(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(malloc, "installed", lambda name: name == "glibc")
    assert main(["train", *TINY_OVERRIDES, "malloc=tcmalloc", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "apt-get install libtcmalloc-minimal4" in err and "Traceback" not in err


def test_the_line_a_run_prints_about_its_malloc(monkeypatch):
    assert malloc_note("glibc") is None  # glibc's, as asked: nothing to say
    monkeypatch.setattr(malloc, "installed", lambda name: name == "glibc")
    assert malloc_note("auto") == (
        "malloc: glibc's (auto: libtcmalloc_minimal.so.4 is not installed; Debian/Ubuntu: apt-get install "
        "libtcmalloc-minimal4)"
    )
    monkeypatch.setattr(malloc, "installed", lambda name: True)  # a script, where nothing preloaded it
    assert malloc_note("jemalloc") == (
        "malloc: jemalloc names jemalloc, and this process runs on glibc's: a malloc is preloaded when a "
        "process starts (the everyprompt command does it; a script: LD_PRELOAD=libjemalloc.so.2)"
    )


def test_a_process_started_for_a_malloc_that_lacks_it_stops(monkeypatch):
    """The guard against starting again and again: the loader refused the library once already."""
    monkeypatch.setattr(malloc, "installed", lambda name: True)
    monkeypatch.setenv(STARTED_FOR, "tcmalloc")
    with pytest.raises(RunError, match="started with libtcmalloc_minimal.so.4 preloaded and runs on glibc's"):
        use_malloc("tcmalloc")


SCRIPT = """
import os, sys
from everyprompt.devices import keep_freed_memory
from everyprompt.devices.malloc import running_malloc, use_malloc
print("before", running_malloc(), flush=True)
print("after", use_malloc(sys.argv[1]), os.environ.get("EVERYPROMPT_MALLOC"), keep_freed_memory(1024))
"""


@TCMALLOC
def test_use_malloc_starts_the_command_again_on_the_library(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), "tcmalloc"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    # the first process ran on glibc's and was replaced (same pid, same arguments) by one on tcmalloc, where
    # glibc's thresholds are not set: nothing uses them
    assert run.stdout.splitlines() == ["before glibc", "before tcmalloc", "after tcmalloc tcmalloc False"]


@TCMALLOC
def test_the_train_command_runs_on_the_malloc_its_config_names(tmp_path):
    argv = ["-m", "everyprompt.cli", "train", *TINY_OVERRIDES, "sft.steps=0", "rl.steps=1", "malloc=auto"]
    run = subprocess.run(
        [sys.executable, *argv, "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "malloc: tcmalloc (preloaded)" in run.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1


@pytest.mark.slow
@TCMALLOC
def test_a_malloc_changes_no_figure_a_run_computes(tmp_path):
    # torch's CPU allocator aligns its own blocks, so the malloc under it should change memory and time,
    # never the arithmetic: the same seed gives every loss, reward and gradient norm bit for bit
    figures = {}
    for name in ("glibc", "tcmalloc"):
        signal = "rewards.function=tests.trainer.flaky_reward:scattered"  # every step has a gradient
        argv = ["-m", "everyprompt.cli", "train", *TINY_OVERRIDES, signal, f"malloc={name}"]
        run = subprocess.run(
            [sys.executable, *argv, "--run-dir", str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        figures[name] = computed_figures(tmp_path / name)
    assert len(figures["glibc"]) == 2 and all("actor/grad_norm" in row for row in figures["glibc"])
    assert figures["tcmalloc"] == figures["glibc"]
