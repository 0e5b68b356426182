"""`everyprompt serve MODEL`: a checkpoint behind an OpenAI-compatible HTTP server (docs/serving.md)."""

from __future__ import annotations

INSTALL = "pip install 'everyprompt[serve]'"


def cmd_serve(args) -> int:
    from everyprompt.logs import quiet_libraries
    from everyprompt.serve.protocol import Limits
    from everyprompt.serve.server import ServeError, serve

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ServeError(f"everyprompt serve needs {err.name}: {INSTALL}") from None
    quiet_libraries()
    for flag in ("batch_size", "max_tokens", "max_prompt_tokens", "max_n"):
        if getattr(args, flag) < 1:
            raise ServeError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    limits = Limits(max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens, max_n=args.max_n)
    serve(
        args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        limits=limits,
        batch_size=args.batch_size,
        precision=args.precision,
        device=args.device,
        name=args.name,
    )
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over a checkpoint (native engine)")
    p.add_argument("model", metavar="MODEL", help="a checkpoint directory or .gguf file")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument(
        "--api-key",
        default=None,
        help="the key clients send as 'Authorization: Bearer KEY' (default: $EVERYPROMPT_API_KEY); "
        "required to listen beyond 127.0.0.1",
    )
    p.add_argument("--name", default=None, help="the model's name in responses (default: MODEL's name)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences decoded together (default 32)")
    p.add_argument("--max-tokens", type=int, default=512, help="largest max_tokens a request may ask")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="longest prompt accepted")
    p.add_argument("--max-n", type=int, default=8, help="most choices (n) a request may ask")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp8"), default="fp32", help="engine weights")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda:N (default auto)")
    p.set_defaults(func=cmd_serve, own_signals=True)  # uvicorn finishes the open responses
