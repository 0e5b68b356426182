"""C7, time to accuracy against TRL on the same card (docs/evidence.md): the cells (arm, seed) not recorded,
one at a time, every arm of a seed before the next seed, in an order that turns with the seed.

    python -m bench.time_to_accuracy                 # every pre-registered seed's missing cells (a GPU)
    python -m bench.time_to_accuracy --seeds 0       # one seed: its three arms (3 x 180 s of training, plus
                                                     # loading and evaluating: about 12 min by estimate)
    python -m bench.time_to_accuracy --smoke         # seed 0 on a tiny model on the CPU, about a minute
    python -m bench.time_to_accuracy --curve         # the curve from the records: a table, c7_curve.png
    python -m bench.evidence --summary               # the contrasts and verdicts so far

Each finished cell is recorded at once in bench/results/evidence.json (`--merge` adds another copy's). A
seed's arms must share one card: a seed some of whose arms were recorded on another machine is run whole
here, the earlier records kept under `superseded`."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, repo_override, repo_path, run_probe
from bench.evidence.plan import COMPARISONS
from bench.evidence.store import load, locked, save
from bench.time_to_accuracy import MARKS_S
from bench.time_to_accuracy.arms import ARMS

NAME, SETUP = "c7", "smollm2"
CELL = Path(__file__).with_name("cell.py")  # each cell's process (bench/common.py's run_probe)
CARD = Path(tempfile.gettempdir()) / "everyprompt-c7-card"  # held while a cell runs (store.locked)
MODEL = Path("models") / "smollm2-135m-instruct"
# --smoke: a 2-layer chat model made on the spot, on the CPU, for 2 seconds of each clock
SMOKE_MARKS = (1.0, 2.0)
SMOKE = [
    "model.dtype=fp32",
    "model.device=cpu",
    "rollout.device=cpu",
    "data.num_train=16",
    "data.num_eval=6",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "rl.micro_batch_size=4",
    "rl.warmup_steps=1",
    "rollout.max_new_tokens=8",
    "malloc=glibc",
]


def order_of(seed: int) -> list[str]:
    """The arms of `seed` in the order they run: turned by one for each seed, so that no arm always runs
    first on a fresh machine."""
    arms = list(ARMS)
    turn = seed % len(arms)
    return arms[turn:] + arms[:turn]


def cell_environment(arm: str, overrides: list[str]) -> dict | None:
    """everyprompt's process on the allocator its config names, as the everyprompt command starts it;
    TRL's on glibc's, as it ships."""
    from everyprompt.config import load_config
    from everyprompt.devices.malloc import preloaded_environment, wanted_malloc

    if ARMS[arm].trainer == "trl":
        return None
    return preloaded_environment(wanted_malloc(load_config(ARMS[arm].config, overrides).malloc))


def smoke_model(work: Path) -> Path:
    """A 2-layer chat model (tiny-chat-moe) saved once: every arm of the smoke starts from it."""
    from bench.quality.algorithms import TINY_MODEL
    from everyprompt.config import load_config
    from everyprompt.models.io import load_model_and_tokenizer, save_pretrained

    directory = work / "start"
    if not (directory / "config.json").is_file():
        config = load_config(None, ["model.preset=tiny-chat-moe", *TINY_MODEL])
        model, tokenizer = load_model_and_tokenizer(config.model, seed=0)
        save_pretrained(model, tokenizer, directory)
    return directory


def expected_cell_s(marks: list[float]) -> float:
    """A cell's seconds before one has run here: its budget, a third more for steps that overrun the last
    mark and for the snapshots, and a minute to load and evaluate."""
    return marks[-1] * 4 / 3 + 60


def pending(body: dict, seeds: list[int], arms: list[str], here: str):
    """The (seed, arm) cells to run, seed by seed in each seed's order; a seed begun on another machine
    is run whole here (`supersede`)."""
    for seed in seeds:
        supersede(body, seed, here)
        for arm in order_of(seed):
            if arm in arms and not any(r["seed"] == seed for r in body["arms"][arm]["runs"]):
                yield seed, arm


def supersede(body: dict, seed: int, here: str) -> None:
    """A seed whose recorded arms are not all in and ran elsewhere is run whole on this machine: its
    records move to `superseded`."""
    runs = {arm: [r for r in body["arms"][arm]["runs"] if r["seed"] == seed] for arm in ARMS}
    recorded = [r for rs in runs.values() for r in rs]
    if recorded and len(recorded) < len(ARMS) and any(r["machine"] != here for r in recorded):
        for arm in ARMS:
            body["arms"][arm]["runs"] = [r for r in body["arms"][arm]["runs"] if r["seed"] != seed]
        body.setdefault("superseded", []).extend(recorded)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", help="default: the pre-registered seeds")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="default: every arm")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (evidence_smoke.json)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--time-left",
        type=float,
        metavar="S",
        help="start no cell that would end more than S seconds after the call began (a lent GPU's call)",
    )
    parser.add_argument(
        "--curve",
        action="store_true",
        help="run nothing: print each arm's accuracy by mark from the records and plot it (curve.py)",
    )
    args = parser.parse_args(argv)
    if args.curve:
        return curve(args.out, args.smoke)
    began = time.monotonic()
    comparison = COMPARISONS[NAME]
    seeds = args.seeds or ([0] if args.smoke else list(comparison.seeds_on(SETUP)))
    work = args.out / "evidence_runs" / ("c7-smoke" if args.smoke else "c7")
    if args.smoke:
        overrides, marks = [f"model.path={smoke_model(work)}", *SMOKE], list(SMOKE_MARKS)
    else:
        if not MODEL.exists():
            parser.error(f"{MODEL} is missing: `make smollm2` first")
        overrides, marks = [], list(MARKS_S)
    path = args.out / ("evidence_smoke.json" if args.smoke else "evidence.json")
    payload = load(path)
    entry = payload["comparisons"].setdefault(NAME, {"title": comparison.title, "setups": {}})
    body = entry["setups"].setdefault(SETUP, {"arms": {}})
    body.update(
        fixed=[repo_override(o) for o in overrides],
        marks_s=marks,
        seeds=list(comparison.seeds_on(SETUP)),
    )
    for arm, spec in ARMS.items():
        body["arms"].setdefault(arm, {"overrides": [], "runs": []})["config"] = repo_path(spec.config)
    here = run_probe(CELL, "--probe", ["machine"])["machine"]
    if "start" not in body:
        body["start"] = run_probe(CELL, "--probe", ["start", overrides, str(work / "start-eval")])
    cell_s = expected_cell_s(marks)
    for seed, arm in pending(body, seeds, args.arms or list(ARMS), here):
        left = None if args.time_left is None else args.time_left - (time.monotonic() - began)
        if left is not None and left < cell_s:
            print(f"c7: {left:.0f} s left, a cell takes about {cell_s:.0f} s: stopping here (the same command "
                  "goes on from the records)")  # fmt: skip
            break
        print(f"c7: {arm}, seed {seed}: {marks[-1]:g} s of training ...", flush=True)
        with locked(CARD):  # a second call on this machine waits rather than share the card's time
            record = run_probe(
                CELL,
                "--probe",
                ["cell", arm, seed, overrides, marks, str(work / f"{arm}-seed{seed}")],
                env=cell_environment(arm, overrides),
            )
        cell_s = max(cell_s, record["seconds"] + 15)  # and its process's start
        body["arms"][arm]["runs"] = sorted([*body["arms"][arm]["runs"], record], key=lambda r: r["seed"])
        payload = save(path, payload, args.smoke, NAME, SETUP)
        print(
            f"  held-out greedy {record['greedy_accuracy']:.1%} after {record['rl_steps']} steps "
            f"({record['train_seconds']:.0f} s of training, {record['seconds']:.0f} s in all)",
            flush=True,
        )
    payload = save(path, payload, args.smoke, NAME, SETUP)
    print(f"wrote {repo_path(path)}")
    return 0


def curve(out: Path, smoke: bool) -> int:
    """The recorded curve: its table printed, its figure written beside the records."""
    from bench.time_to_accuracy.curve import curve_table, plot

    path = out / ("evidence_smoke.json" if smoke else "evidence.json")
    body = load(path)["comparisons"].get(NAME, {}).get("setups", {}).get(SETUP)
    if not body or not any(arm["runs"] for arm in body["arms"].values()):
        print(f"c7: no run recorded in {repo_path(path)} yet")
        return 1
    figure = out / ("c7_curve_smoke.png" if smoke else "c7_curve.png")
    plot(body, figure, f"C7 ({SETUP}): accuracy by seconds of training")
    print(curve_table(body))
    print(f"wrote {repo_path(figure)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
