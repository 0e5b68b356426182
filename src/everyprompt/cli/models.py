"""`everyprompt convert | upcycle`: the commands that make model checkpoints."""

from __future__ import annotations


def cmd_convert(args) -> int:
    from everyprompt.logs import quiet_libraries
    from everyprompt.models.gguf import convert

    quiet_libraries()
    print(f"converting {args.model} (dequantising to float32) ...", flush=True)
    out = convert(args.model, args.out)
    print(f"wrote {out} (safetensors, tokenizer and chat template): use it as model.path or a checkpoint")
    return 0


def cmd_upcycle(args) -> int:
    from everyprompt.logs import quiet_libraries
    from everyprompt.models.upcycle import upcycle

    quiet_libraries()
    print(f"upcycling {args.model}: each MLP into {args.experts} experts, top-{args.top_k} ...", flush=True)
    out = upcycle(args.model, args.out, args.experts, args.top_k, args.seed)
    print(f"wrote {out} (Mixtral, same logits as the dense model at initialisation): use it as model.path")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("convert", help="a .gguf model file to a safetensors checkpoint directory")
    p.add_argument(
        "model", metavar="FILE.gguf", help="a GGUF model file (weights are dequantised to float32)"
    )
    p.add_argument("out", metavar="OUT_DIR", help="the checkpoint directory to write (must not hold files)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser(
        "upcycle", help="a dense Llama-family model to a Mixtral MoE (each MLP copied into E experts)"
    )
    p.add_argument(
        "model", metavar="DENSE", help="a checkpoint directory or .gguf file (llama, mistral, qwen2)"
    )
    p.add_argument("out", metavar="OUT_DIR", help="the checkpoint directory to write (must not hold files)")
    p.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the routers' initial weights")
    p.set_defaults(func=cmd_upcycle)
