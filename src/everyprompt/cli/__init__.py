"""The `everyprompt` command: each command parses its arguments and calls the library.

    everyprompt recipes
    everyprompt fetch smollm2|smollm2-moe [--dir models]
    everyprompt demo [RECIPE|CONFIG.yaml] [--seed S] [KEY=VALUE ...]
    everyprompt train [RECIPE|CONFIG.yaml] [KEY=VALUE ...] [--run-dir D] [--resume RUN_DIR]
    everyprompt sft [CONFIG.yaml] [KEY=VALUE ...] [--run-dir D]
    everyprompt eval CHECKPOINT [--data FILE] [CONFIG.yaml] [KEY=VALUE ...]
    everyprompt score INPUT.jsonl --reward math [--completion-field F] [--answer-field F] [-o OUT]
    everyprompt filter DATA|builtin --model CKPT [--samples K] [--low L] [--high H] [--out DIR]
    everyprompt sweep [CONFIG.yaml] KEY=v1,v2 ... [--seeds 0,1,2] [--parallel N] [--run-dir D]
    everyprompt sweep --resume SWEEP_DIR
    everyprompt report RUN_OR_SWEEP [RUN ...] [--html [REPORT.html]]
    everyprompt convert FILE.gguf OUT_DIR

A config argument is a YAML file, or the bare name of a recipe shipped with the package (`recipes`).

`main.py` builds the parser from the command groups (`start.py`, `runs.py`, `data.py`, `models.py`, `sweep.py`,
`report.py`: each adds its commands' arguments and the function that runs them) and turns failures into
exit codes: bad input exits 2 with a one-line message, a run that went wrong exits 1, a stopped run
130 / 143.
"""

from everyprompt.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
