"""`everyprompt convert`: the commands that make model checkpoints."""

from __future__ import annotations


def cmd_convert(args) -> int:
    from everyprompt.logs import quiet_libraries
    from everyprompt.models.gguf import convert

    quiet_libraries()
    print(f"converting {args.model} (dequantising to float32) ...", flush=True)
    out = convert(args.model, args.out)
    print(f"wrote {out} (safetensors, tokenizer and chat template): use it as model.path or a checkpoint")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("convert", help="a .gguf model file to a safetensors checkpoint directory")
    p.add_argument(
        "model", metavar="FILE.gguf", help="a GGUF model file (weights are dequantised to float32)"
    )
    p.add_argument("out", metavar="OUT_DIR", help="the checkpoint directory to write (must not hold files)")
    p.set_defaults(func=cmd_convert)
