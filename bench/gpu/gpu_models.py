"""The models bench/gpu/suite.sh measures: SmolLM2-135M-Instruct and its 8-expert sparse upcycle, or (with
`--smoke`) a tiny dense Llama and its upcycle, the same two shapes at a size a CPU runs in seconds.

    python -m bench.gpu.gpu_models --receive        # a lent GPU, first call: keep the GGUF's first part
    python -m bench.gpu.gpu_models                  # SmolLM2 from models/ (or its two parts), then its upcycle
    python -m bench.gpu.gpu_models --smoke DIR      # the tiny pair under DIR
    python -m bench.gpu.gpu_models --dense-only     # no upcycle (a call that runs no MoE bench saves its write)

The GGUF (94 MiB) is more than one call to a lent GPU carries (64 MiB), so `bench/gpu/suite.sh --stage`
splits it into two halves under .gpu-model/; the first call keeps its half in models/ (`--receive`), the
second brings the other and this joins them. `everyprompt fetch smollm2`'s own code then checks the file's
SHA-256 and converts it. Prints the model directories, one a line: `dense PATH`, then `moe PATH`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
STAGED = ROOT / ".gpu-model"  # the halves `gpu_suite.sh --stage` writes (ignored by git; carried)
GGUF = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
DENSE = MODELS / "smollm2-135m-instruct"
MOE = MODELS / "smollm2-moe8"


def receive() -> None:
    """Keep the first half, carried by this call, in models/ (kept between calls on a warm machine)."""
    MODELS.mkdir(exist_ok=True)
    shutil.copyfile(STAGED / "1", MODELS / (GGUF.name + ".1"))
    print(f"kept {GGUF.name}.1 in models/")


def smollm2(dense_only: bool = False) -> dict[str, Path]:
    if not GGUF.is_file() and (MODELS / (GGUF.name + ".1")).is_file() and (STAGED / "2").is_file():
        with open(GGUF, "wb") as joined:
            for part in (MODELS / (GGUF.name + ".1"), STAGED / "2"):
                joined.write(part.read_bytes())
    if not GGUF.is_file():
        sys.exit(f"gpu_models: {GGUF.relative_to(ROOT)} is missing (nor are both halves here)")
    from everyprompt.models.fetch import fetch

    fetch("smollm2", MODELS)
    return {"dense": DENSE} if dense_only else {"dense": DENSE, "moe": upcycled(DENSE, MOE)}


def tiny(directory: Path, dense_only: bool = False) -> dict[str, Path]:
    """A random-init 2-layer Llama with the character tokenizer (weights N(0, 0.2): outputs vary by
    token), and its upcycle."""
    import torch
    from transformers import LlamaForCausalLM

    from everyprompt.models import build_char_tokenizer
    from everyprompt.models.presets import tiny_dense_config

    tokenizer = build_char_tokenizer()
    ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    config = tiny_dense_config(len(tokenizer), *ids)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    dense = directory / "tiny-dense"
    model.save_pretrained(dense)
    tokenizer.save_pretrained(dense)
    return (
        {"dense": dense} if dense_only else {"dense": dense, "moe": upcycled(dense, directory / "tiny-moe8")}
    )


def upcycled(dense: Path, target: Path) -> Path:
    """`dense` upcycled to 8 experts, top 2 (once: an existing one is kept)."""
    from everyprompt.models.upcycle import upcycle

    if not (target / "config.json").is_file():
        upcycle(dense, target, experts=8, top_k=2, seed=0)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--receive", action="store_true", help="keep the first half of the GGUF")
    parser.add_argument("--smoke", type=Path, help="write the tiny pair under this directory instead")
    parser.add_argument("--dense-only", action="store_true", help="the dense model alone, no upcycle")
    args = parser.parse_args(argv)
    if args.receive:
        receive()
        return 0
    made = tiny(args.smoke, args.dense_only) if args.smoke else smollm2(args.dense_only)
    for kind, directory in made.items():
        print(kind, directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
