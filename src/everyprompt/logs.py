"""Console and logging helpers every process of a run uses: our progress bars, quiet library chatter, and
everyprompt's warnings kept in the run directory too (the cross-run report lists them)."""

from __future__ import annotations

import logging
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class _RunWarnings(logging.FileHandler):
    """everyprompt's warnings, also kept in a file of the run directory."""

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if not logging.getLogger().handlers:  # nobody else shows it: print it as Python would have
            logging.lastResort.handle(record)


def stop_recording_warnings() -> None:
    """Warnings are no longer written to a run directory's file (it is closed)."""
    logger = logging.getLogger("everyprompt")
    for handler in [h for h in logger.handlers if isinstance(h, _RunWarnings)]:
        logger.removeHandler(handler)
        handler.close()


def record_warnings(path: str | Path) -> None:
    """From now on everyprompt's warnings go to `path` too (one run directory at a time)."""
    stop_recording_warnings()
    logger = logging.getLogger("everyprompt")
    handler = _RunWarnings(path, encoding="utf-8", delay=True)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)


def quiet_libraries() -> None:
    """Silence library progress bars and advisory warnings that would bury our own output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def progress(console: Console, *extra) -> Progress:
    """Our progress bar: description, bar, n/N, elapsed, remaining, then `extra` columns."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        *extra,
        console=console,
    )


class RateColumn(ProgressColumn):
    """Items per second, e.g. `12.3 prompts/s` (blank until rich has measured a speed)."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        return Text(f"{task.speed:.1f} {self.unit}/s" if task.speed else "", style="progress.data.speed")


class progress_bar:  # noqa: N801  (used as a context manager, like a function)
    """A rich progress bar over `total` items (with their rate when `unit` names them); the context value
    is `advance(n)`. No-op when disabled."""

    def __init__(
        self,
        total: int,
        description: str,
        enabled: bool = True,
        console: Console | None = None,
        unit: str | None = None,
    ):
        self._progress = None
        if enabled:
            extra = (RateColumn(unit),) if unit else ()
            self._progress = progress(console or Console(stderr=True), *extra)
            self._task = self._progress.add_task(description, total=total)

    def __enter__(self):
        if self._progress is None:
            return lambda n: None
        self._progress.start()
        return lambda n: self._progress.advance(self._task, n)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
