"""The README's first screen: what everyprompt is and for whom, install, the demo, a real model, a GPU and
the docs, in 40 lines; every command on it parses, names recipes that ship, and links pages that exist."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from everyprompt.cli import build_parser
from everyprompt.config.recipes import find_config

ROOT = Path(__file__).resolve().parents[1]
FIRST_SCREEN = 40


def _first_screen() -> str:
    return "\n".join((ROOT / "README.md").read_text().splitlines()[:FIRST_SCREEN])


def test_the_first_screen_answers_what_for_whom_install_demo_real_model_gpu_and_docs():
    screen = _first_screen()
    for needed in ("Mixture-of-Experts", "verl, TRL", "pip install", "make demo", "make test",
                   "everyprompt demo", "everyprompt fetch smollm2", "On a GPU", "**Docs**"):  # fmt: skip
        assert needed in screen, needed
    for page in re.findall(r"\]\((docs/[\w-]+\.md)\)", screen):
        assert (ROOT / page).is_file(), page
    assert len(re.findall(r"\]\(docs/", screen)) == len(list((ROOT / "docs").glob("*.md")))  # every page


def test_every_command_on_the_first_screen_parses_and_names_recipes_that_ship():
    commands = [
        line.split("#", 1)[0].strip()
        for line in _first_screen().splitlines()
        if line.startswith("everyprompt ")
    ]
    assert len(commands) >= 6
    parser = build_parser()
    for command in commands:
        args, extra = parser.parse_known_args(shlex.split(command)[1:])
        assert all("=" in e for e in extra), command
        config = [value for value in getattr(args, "config", []) if "=" not in value]
        for name in config:
            assert find_config(name).is_file(), command


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_install_section_names_every_extra_with_what_it_brings_and_no_other():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("<!-- extras -->", 1)[1].split("<!-- /extras -->", 1)[0]
    named = re.findall(r"`(\w+)`\s+\(([^)]+)\)", section)
    assert {name for name, _ in named} == set(_pyproject()["project"]["optional-dependencies"])
    assert all(len(what) > 3 for _, what in named)


def test_the_install_lines_are_those_of_a_clone_and_the_makefile_agrees():
    screen = _first_screen()
    installs = [
        line.split("#", 1)[0].strip() for line in screen.splitlines() if line.startswith("pip install")
    ]
    assert installs and all(line.startswith("pip install -e ") for line in installs), installs
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"^TORCH := (torch==[\d.]+)$", makefile, re.M).group(1)
    assert pin in screen  # the torch the Makefile installs is the one the README says
    assert re.search(r"^TORCH_INDEX \?=", makefile, re.M) and "TORCH_INDEX=" in screen
    assert "--index-url" in screen  # how a user gets the CPU build themselves
    lower = _pyproject()["project"]["dependencies"]
    assert any(dep.startswith("torch>=") and "<" in dep for dep in lower)  # a range, not a pin


def test_each_accuracy_on_the_first_screen_is_the_results_tables():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- smollm2-results -->", 1)[1].split("<!-- /smollm2-results -->", 1)[0]
    before = set(re.findall(r"^\| \d+ \| ([\d.]+%) \|", table, re.M))
    assert len(before) == 1
    said = re.search(r"held-out accuracy before RL: ([\d.]+%)", _first_screen()).group(1)
    assert {said} == before
