"""A config's Hub names (model ids, dataset files) fetched or found in the cache and pinned to their commit
before a run writes anything (`pin_hub_names`)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from everyprompt.config import Config
from everyprompt.hub import check_model_name, pinned
from everyprompt.models.catalog import fetch_hint

# the keys that may name a Hub model id or dataset file, and whether a model name that is neither a path nor an
# id is refused here (a judge or reward model, which would fail later in a reward worker) or left to its
# loader (model.path: it fails in the run directory, where a sweep's report finds the failed cell)
HUB_NAMED = {
    "model.path": "loaded",
    "data.train_file": "data",
    "data.eval_file": "data",
    "rewards.genrm.model": "checked",
    "rewards.scalar_rm.model": "checked",
    "rl.teacher.model": "checked",
    "rl.teacher.models": "checked",  # value -> teacher: each checked under rl.teacher.models.VALUE
}


def pin_hub_names(config: Config, console: Console) -> Config:
    """`config` with each Hub name it holds fetched (or found in the cache) and written with its commit
    (`ORG/NAME@COMMIT`, `hf://datasets/ORG/NAME@COMMIT/PATH`), so the run's config.yaml repeats it
    exactly; a name that does not resolve exits 2 now, naming its key, before the run writes anything."""
    tree = config.model_dump(mode="json")
    changed = False
    for key, kind in HUB_NAMED.items():
        *sections, field = key.split(".")
        node = tree
        for section in sections:
            node = node[section]
        named = node[field] if isinstance(node[field], dict) else {field: node[field]}
        holder = node[field] if isinstance(node[field], dict) else node
        for name_key, name in named.items():
            if name is None:
                continue
            where = key if holder is node else f"{key}.{name_key}"
            hint = "" if kind == "data" else fetch_hint(Path(name))
            if kind == "checked":
                check_model_name(name, where, hint)
            holder[name_key] = pinned(name, where, hint)
            if holder[name_key] != name:
                changed = True
                console.print(f"{where}: {name} -> {holder[name_key]} (kept in config.yaml)", markup=False)
    return Config.model_validate(tree) if changed else config
