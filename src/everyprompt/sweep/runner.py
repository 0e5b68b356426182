"""Running a sweep's cells: each an `everyprompt train` process with its own run directory and log.

A cell is done when its run wrote `eval.json` (the held-out evaluation after the last step, written
atomically). Running a sweep again (`everyprompt sweep --resume SWEEP`) skips the done cells, resumes a
cell that was cut short from its own checkpoints (`train --resume`: whichever phase was running), and
retries a failed one. A cell that fails is reported with its log's last line and skipped; the others go
on. Every cell dies with the sweep (the kernel kills it when the sweep process dies); the first Ctrl-C or
SIGTERM asks every running cell to checkpoint and stop, a second one stops them at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from everyprompt.processes import StopRequested, die_with_parent
from everyprompt.run.files import write_json_atomic
from everyprompt.run.layout import RunLayout, SweepLayout
from everyprompt.sweep.plan import Cell, SweepPlan

LOG_EVERY_S = 60.0


@dataclass
class Outcome:
    """How one cell ended in this sweep process."""

    state: str  # done | failed | stopped | skipped (done before this process started)
    seconds: float = 0.0
    exit_code: int | None = None
    error: str = ""  # the last line of the cell's log when it failed


def cell_is_done(cell_dir: Path) -> bool:
    return RunLayout(cell_dir).eval_results.is_file()  # what `everyprompt train` writes last


def held_out_accuracy(cell_dir: Path) -> float | None:
    """The greedy accuracy in a finished cell's eval.json (None before it has one)."""
    path = RunLayout(cell_dir).eval_results
    accuracy = json.loads(path.read_text()).get("greedy_accuracy") if path.is_file() else None
    return accuracy if isinstance(accuracy, float) else None


def cell_command(sweep_dir: Path, cell: Cell, fixed: list[str]) -> list[str]:
    """`everyprompt train` for a cell: from the base config, or resumed when it has started before."""
    sweep = SweepLayout(sweep_dir)
    cell_dir = sweep.cell(cell.name)
    train = [sys.executable, "-m", "everyprompt.cli", "train"]
    if cell_dir.started():
        return [*train, "--resume", str(cell_dir.root)]
    return [*train, str(sweep.base_config), *fixed, *cell.overrides, "--run-dir", str(cell_dir.root)]


def _last_line(path: Path) -> str:
    """The last non-empty line of a log (its tail only: logs can be long)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - 4096))
            lines = [line.strip() for line in handle.read().decode("utf-8", "replace").splitlines()]
    except OSError:
        return ""
    lines = [line for line in lines if line]
    return lines[-1] if lines else ""


def _last_step(path: Path) -> int:
    """The step of a metrics.jsonl's last complete record (0 when there is none)."""
    line = _last_line(path)
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 0


def cell_progress(cell_dir: Path) -> int:
    """Steps a cell has done: its SFT steps plus its RL steps, read from its metrics files."""
    layout = RunLayout(cell_dir)
    return _last_step(layout.sft.metrics) + _last_step(layout.metrics)


class SweepRunner:
    """Runs the cells of a plan, `parallel` at a time, with a progress display across them."""

    def __init__(self, plan: SweepPlan, sweep_dir: Path, parallel: int = 1, console: Console | None = None):
        if parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {parallel}")
        self.plan, self.sweep_dir, self.parallel = plan, sweep_dir, parallel
        self.console = console or Console(stderr=True)
        self.outcomes: dict[str, Outcome] = {}
        self._signum: int | None = None

    def _environment(self) -> dict[str, str]:
        """Cells running side by side share the cores: each gets its part unless the user set threads."""
        env = dict(os.environ)
        if self.parallel > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.parallel))
        return env

    def _launch(self, cell: Cell) -> tuple[subprocess.Popen, float, object]:
        cell_dir = self.sweep_dir / cell.name
        cell_dir.mkdir(parents=True, exist_ok=True)
        command = cell_command(self.sweep_dir, cell, self.plan.fixed)
        log = open(RunLayout(cell_dir).cell_log, "ab")
        log.write(f"\n$ {' '.join(command)}\n".encode())
        log.flush()
        parent = os.getpid()
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self._environment(),
            start_new_session=True,  # the terminal's Ctrl-C reaches the sweep, which tells each cell once
            preexec_fn=lambda: die_with_parent(parent),
        )
        return process, time.perf_counter(), log

    def _handle(self, signum, _frame) -> None:
        if self._signum is not None:  # asked twice: stop the cells now
            raise KeyboardInterrupt
        self._signum = signum
        self.console.print(
            f"\n{signal.Signals(signum).name}: the running cells checkpoint and stop; send it again to stop "
            "them at once"
        )

    def _previous_status(self) -> dict:
        path = SweepLayout(self.sweep_dir).status
        try:
            status = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except ValueError:  # written atomically, so only a hand-edited file; the times are then unknown
            return {}
        return status if isinstance(status, dict) else {}

    def _save_status(self) -> None:
        status = {name: vars(outcome) for name, outcome in self.outcomes.items()}
        write_json_atomic(SweepLayout(self.sweep_dir).status, status)

    def run(self) -> dict[str, Outcome]:
        """Run every cell not done yet; returns each cell's outcome (StopRequested after a signal)."""
        cells = self.plan.cells()
        pending = []
        before = self._previous_status()
        for cell in cells:
            if cell_is_done(self.sweep_dir / cell.name):  # done before: its time is the one it took then
                seconds = float((before.get(cell.name) or {}).get("seconds") or 0.0)
                self.outcomes[cell.name] = Outcome("skipped", seconds, 0)
            else:
                pending.append(cell)
        running: dict[str, tuple[Cell, subprocess.Popen, float, object]] = {}
        totals = {c.name: self._total_steps(c) for c in cells}
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        overall = progress.add_task(
            "[bold]sweep cells", total=len(cells), completed=len(cells) - len(pending)
        )
        bars: dict[str, int] = {}
        forwarded = False  # the running cells were told of a signal
        reported = time.monotonic()  # without a terminal (a log file) the bars do not draw: a line a minute
        try:
            with progress:
                while pending or running:
                    while pending and len(running) < self.parallel and self._signum is None:
                        cell = pending.pop(0)
                        running[cell.name] = (cell, *self._launch(cell))
                        bars[cell.name] = progress.add_task(f"  {escape(cell.name)}", total=totals[cell.name])
                    if self._signum is not None and not forwarded:
                        forwarded = True
                        for cell in pending:
                            self.outcomes[cell.name] = Outcome("stopped")
                        pending.clear()
                        for _, process, _, _ in running.values():
                            process.send_signal(signal.SIGTERM)
                    for name in list(running):
                        cell, process, started, log = running[name]
                        progress.update(bars[name], completed=cell_progress(self.sweep_dir / name))
                        code = process.poll()
                        if code is None:
                            continue
                        log.close()
                        del running[name]
                        progress.remove_task(bars.pop(name))
                        self.outcomes[name] = self._outcome(cell, code, time.perf_counter() - started)
                        self._save_status()
                        progress.advance(overall)
                        self._print_outcome(name)
                    if not self.console.is_terminal and running and time.monotonic() - reported > LOG_EVERY_S:
                        reported = time.monotonic()
                        self.console.print(
                            f"{len(self.outcomes)}/{len(cells)} cells ended; running: "
                            + ", ".join(
                                f"{name} step {cell_progress(self.sweep_dir / name)}/{totals[name]}"
                                for name in running
                            ),
                            markup=False,
                            highlight=False,
                        )
                    time.sleep(0.2)
        except KeyboardInterrupt:
            for _, process, _, _ in running.values():
                process.kill()
            for cell, process, _, log in running.values():
                process.wait()
                log.close()
                self.outcomes[cell.name] = Outcome("stopped", exit_code=process.returncode)
            self._save_status()
            raise StopRequested(signal.SIGINT, self._resume_hint("stopped")) from None
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if self._signum is not None:
            raise StopRequested(self._signum, self._resume_hint("stopped after checkpoints"))
        return self.outcomes

    def _resume_hint(self, what: str) -> str:
        return f"sweep {what}; continue it with: everyprompt sweep --resume {self.sweep_dir}"

    def _total_steps(self, cell: Cell) -> int:
        config = self.plan.config_of(cell)
        return config.sft.steps + config.rl.steps

    def _outcome(self, cell: Cell, code: int, seconds: float) -> Outcome:
        cell_dir = self.sweep_dir / cell.name
        # a cell stopped by the signal we sent: after its checkpoint (130 / 143), or before it had set up
        # its handler (killed by the signal itself)
        signalled = self._signum is not None and code in (
            -signal.SIGINT, -signal.SIGTERM, 128 + signal.SIGINT, 128 + signal.SIGTERM
        )  # fmt: skip
        # done: a clean exit with its evaluation written, or our signal killing it on its way out after
        # that (a resume would skip it: its work is complete)
        if (code == 0 or signalled) and cell_is_done(cell_dir):
            return Outcome("done", seconds, code)
        if signalled:
            return Outcome("stopped", seconds, code)
        return Outcome("failed", seconds, code, _last_line(RunLayout(cell_dir).cell_log))

    def _print_outcome(self, name: str) -> None:
        outcome = self.outcomes[name]
        if outcome.state == "done":
            accuracy = held_out_accuracy(self.sweep_dir / name)
            shown = f"held-out greedy {accuracy:.1%}, " if accuracy is not None else ""
            self.console.print(f"[green]done[/] {escape(name)} ({shown}{outcome.seconds:.0f} s)")
        elif outcome.state == "failed":
            self.console.print(
                f"[red]failed[/] {escape(name)} (exit code {outcome.exit_code}): {escape(outcome.error)}\n"
                f"  log: {escape(str(SweepLayout(self.sweep_dir).cell(name).cell_log))}",
                highlight=False,
            )
        else:
            self.console.print(f"stopped {name}")
