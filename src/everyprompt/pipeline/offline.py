"""A run's pass-rate store and ZVE stage 0, the offline filter: before RL, the starting policy's pass rate
on each prompt is estimated and only prompts with low < p < high are kept (docs/zve.md). Its result is
saved in the run directory, so a resumed run reuses it (and records its estimates in the store again when
RL restarts from its beginning)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

from everyprompt.config import Config, ConfigError
from everyprompt.data import DataError
from everyprompt.data.passrate import PassRateStore
from everyprompt.run.files import write_json_atomic
from everyprompt.run.layout import RunLayout
from everyprompt.zve import seeded_sample
from everyprompt.zve.workflow import filter_counts, run_offline_filter


class OfflineFilter:
    def __init__(self, config: Config, layout: RunLayout, console: Console):
        self.config, self.layout, self.console = config, layout, console

    @property
    def enabled(self) -> bool:
        return self.config.zve.enabled and self.config.zve.filter.enabled

    def pass_rate_store(self) -> PassRateStore:
        """The run's store, seeded from `zve.pass_rates` when the run starts."""
        zve = self.config.zve
        path = self.layout.pass_rates
        fresh = not path.exists()
        store = PassRateStore(path, ema_decay=zve.retirement.ema_decay)
        if fresh and zve.pass_rates:
            source = Path(zve.pass_rates)
            if not source.is_file():
                raise ConfigError(f"config key 'zve.pass_rates': no pass-rate store at {source}")
            store.load_state_dict(PassRateStore(source).state_dict())
        return store

    def run(self, model, tokenizer, rows: list[dict], store: PassRateStore) -> tuple[list[dict], int]:
        """Estimate pass rates with the starting policy and keep low < p < high: the kept rows and the
        number of rollouts the estimate cost."""
        config, rules = self.config, self.config.zve.filter
        chosen = seeded_sample(range(len(rows)), rules.max_prompts, config.seed)
        candidates = [rows[i] for i in chosen]
        started = time.perf_counter()
        estimate, result = run_offline_filter(model, tokenizer, candidates, config, store)
        kept = [chosen[i] for i in result.kept]
        report = {
            "prompts": len(rows),
            "estimated": len(candidates),
            **filter_counts(estimate, result, rules),
            "seconds": time.perf_counter() - started,
            "rollouts": len(candidates) * rules.samples,
            "kept_indices": kept,
            "records": estimate.records(candidates),  # the store's step -1, again on a resume
        }
        write_json_atomic(self.layout.filter_result, report)
        self.console.print(
            f"offline filter: kept {len(kept)} of {len(candidates)} prompts "
            f"({result.too_easy} too easy, {result.too_hard} too hard) in {report['seconds']:.0f} s"
        )
        if not kept:
            raise DataError(
                f"the offline filter kept no prompt ({result.too_easy} too easy, {result.too_hard} too hard); "
                "widen zve.filter.low / zve.filter.high"
            )
        return [rows[i] for i in kept], len(candidates) * rules.samples

    def report(self) -> dict:
        """The saved result of the filter that ran."""
        report = self.layout.filter_result
        if not report.is_file():
            raise DataError(f"{report}: missing; the run's offline filter result is needed to resume")
        return json.loads(report.read_text())

    def kept_rows(self, rows: list[dict], store: PassRateStore | None = None) -> list[dict]:
        """`rows` (the config's RL prompts) after the filter when it ran (its kept list is saved). With
        `store`, the filter's pass rates are recorded in it again (RL restarts from its start)."""
        if not self.enabled:
            return rows
        report = self.report()
        if store is not None:
            store.record([tuple(r) for r in report["records"]], step=-1)
        return [rows[i] for i in report["kept_indices"]]
