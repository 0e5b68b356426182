"""The rollout engine protocol (rollout/base.py: `RolloutEngine`) is all that the rest of everyprompt reads
of an engine: a caller that reads an attribute the protocol lacks fails here, by the line. What an engine
offers beyond it is one declared member, `offers`, read through `offers(engine, what)`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from everyprompt.rollout import ENGINE_OFFERS, RolloutEngine, offers
from everyprompt.rollout.native import NativeEngine

SRC = Path(__file__).resolve().parents[2] / "src" / "everyprompt"
# the engines themselves read their own members
ENGINES = ("rollout/native/", "rollout/hf.py")
# reads of a concrete engine's own members, where the caller made that engine itself
CONCRETE = {"distributed/backend.py": {"close"}}  # it builds the RayEngine and closes it with the run
READ = re.compile(r"\bengine\.(\w+)|getattr\(\s*[\w.]*engine\w*\s*,\s*\"(\w+)\"")


def protocol_members() -> set[str]:
    return set(RolloutEngine.__annotations__) | {n for n in vars(RolloutEngine) if not n.startswith("_")}


def reads(text: str) -> set[str]:
    """The engine attributes `text` reads (`engine.X`, `self.engine.X`, `getattr(engine, "X")`)."""
    return {a or b for a, b in READ.findall(text)}


def test_the_scan_sees_reads_and_getattr():
    assert reads("x = self.engine.stats; engine.generate(r, p)") == {"stats", "generate"}
    assert reads('getattr(self.engine, "places", False)') == {"places"}  # how flags used to be read


def test_callers_read_only_what_the_protocol_declares():
    members = protocol_members()
    assert {
        "stats",
        "can_record_routes",
        "offers",
        "generate",
        "load_weights",
        "sleep",
        "from_model",
    } <= members
    undeclared, seen = [], set()
    for path in sorted(SRC.rglob("*.py")):
        name = path.relative_to(SRC).as_posix()
        if name.startswith(ENGINES):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for attribute in reads(line):
                seen.add(attribute)
                if attribute not in members | CONCRETE.get(name, set()):
                    undeclared.append(f"{name}:{number}: engine.{attribute}")
    assert not undeclared, "read of an engine but not in RolloutEngine: " + "; ".join(undeclared)
    assert {"generate", "load_weights", "stats"} <= seen  # the scan found the callers


def test_offers_names_what_an_engine_declares_and_refuses_unknown_names():
    assert all(offers(NativeEngine, what) for what in ENGINE_OFFERS)

    class Plain:  # a user's engine that declares nothing offers nothing
        pass

    assert not any(offers(Plain, what) for what in ENGINE_OFFERS)
    with pytest.raises(ValueError, match="an engine offers one of device, compile, cuda_graphs, episodes"):
        offers(NativeEngine, "places")
