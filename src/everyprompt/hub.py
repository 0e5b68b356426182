"""Models and datasets by their Hugging Face Hub names: the one resolver that turns such a name into a local
path, and the pinned form (with the commit) a run records.

Models: a name that exists on this machine (a directory, a .gguf file) is used as it is, whatever its shape.
Else a name shaped `ORG/NAME` or `ORG/NAME@REVISION` is a Hub id: its snapshot is taken from the standard
Hugging Face cache, or fetched into it with `huggingface_hub` (the files a checkpoint loads from: config,
weights, tokenizer, chat template; not other formats' weights), and everything after this sees that
directory.

Datasets: `hf://datasets/ORG/NAME/PATH` or `hf://datasets/ORG/NAME@REVISION/PATH` (the form of
`huggingface_hub`'s HfFileSystem) is one file of a dataset repo, fetched into the same cache.

Offline (`HF_HUB_OFFLINE=1`, or the Hub out of reach) the cache serves; a name the cache lacks is a
`HubError` (exit 2) naming it, the cache and the command that fetches it. A download that broke off is left
as `huggingface_hub` leaves it (finished files only in the snapshot, the rest as `.incomplete` blobs); a
model snapshot without its config or weights is refused, saying so, never loaded half.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from everyprompt.errors import InputError

_REPO = r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*"
# ORG/NAME with the characters the Hub allows, then an optional @REVISION (a branch, a tag or a commit)
HUB_ID = re.compile(rf"(?P<repo>{_REPO})(?:@(?P<revision>.*))?")
DATASETS = "hf://datasets/"
# hf://datasets/ORG/NAME[@REVISION]/PATH
HUB_DATASET = re.compile(rf"hf://datasets/(?P<repo>{_REPO})(?:@(?P<revision>[^/]*))?(?:/(?P<file>.*))?")
# what a checkpoint directory loads from (AutoModel, AutoTokenizer, chat templates)
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]
WEIGHTS_INDEX = "model.safetensors.index.json"

_resolved: dict[tuple, str] = {}  # (kind, repo, revision, file, cache) -> local path, once a process


class HubError(InputError):
    """A name that is neither a local path nor a Hub model or dataset this machine has or can fetch."""


def hub_id(name: str, what: str = "model") -> tuple[str, str | None] | None:
    """(repo, revision or None) of a name shaped like a Hub id, or None; HubError for an empty revision
    (naming `what`, the key or option that gave the name)."""
    match = HUB_ID.fullmatch(name)
    if match is None:
        return None
    revision = match["revision"]
    if revision is not None and not revision.strip():
        raise HubError(
            f"{what}={name}: an empty revision after '@' (expected ORG/NAME@BRANCH, TAG or COMMIT)"
        )
    return match["repo"], revision


def is_hub_name(name: str | Path, what: str = "model") -> bool:
    """Whether `name` is resolved as a Hub model id: shaped like one, and no local path."""
    return not Path(name).exists() and hub_id(str(name), what) is not None


def is_hub_dataset(path: str | Path) -> bool:
    """Whether `path` names a file on the Hub (`hf://...`; checked by `dataset_file`)."""
    return str(path).startswith("hf://")


def dataset_file(path: str, what: str = "data file") -> tuple[str, str | None, str]:
    """(repo, revision or None, file in the repo) of `hf://datasets/ORG/NAME[@REVISION]/PATH`; HubError
    naming `what` (the key or option) for any other `hf://` path."""
    match = HUB_DATASET.fullmatch(path)
    expected = "expected hf://datasets/ORG/NAME/PATH or hf://datasets/ORG/NAME@REVISION/PATH"
    if match is None:
        raise HubError(f"{what}={path}: not a dataset file on the Hub; {expected}")
    if match["revision"] is not None and not match["revision"].strip():
        raise HubError(f"{what}={path}: an empty revision after '@'; {expected}")
    if not match["file"] or match["file"].endswith("/"):
        raise HubError(f"{what}={path}: names no file in the repo {match['repo']}; {expected}")
    return match["repo"], match["revision"], match["file"]


def resolve_model(name: str | Path, what: str = "model", hint: str = "") -> Path:
    """The local path of a model named `name` (`what`: the key or option that named it, and `hint`: what
    else a missing one may be, for messages): the Hub id's snapshot for a name shaped like one that is not
    a local path, else `name` itself (a path, which its loader checks and names if it is not one)."""
    if not is_hub_name(name, what):
        return Path(name)
    repo, revision = hub_id(str(name), what)
    return Path(_fetch("model", repo, revision, None, what, str(name), hint))


def resolve_data(path: str | Path, what: str = "data file") -> Path:
    """The local path of a data file: a Hub dataset file's place in the cache, else `path` itself."""
    if not is_hub_dataset(path):
        return Path(path)
    repo, revision, file = dataset_file(str(path), what)
    return Path(_fetch("dataset", repo, revision, file, what, str(path), ""))


def pinned(name: str, what: str, hint: str = "") -> str:
    """`name` with the commit it resolves to, so a run can be repeated exactly: `ORG/NAME@COMMIT` for a
    model id, `hf://datasets/ORG/NAME@COMMIT/PATH` for a dataset file; any other name unchanged."""
    if is_hub_dataset(name):
        repo, _, file = dataset_file(name, what)
        return f"{DATASETS}{repo}@{_commit_of(resolve_data(name, what))}/{file}"
    if is_hub_name(name, what):
        repo, _ = hub_id(name, what)
        return f"{repo}@{_commit_of(resolve_model(name, what, hint))}"
    return name


def check_model_name(name: str, what: str, hint: str = "") -> None:
    """A model's name is a path on this machine or shaped like a Hub id: else a HubError naming `what`."""
    if not Path(name).exists() and hub_id(name, what) is None:
        raise HubError(
            f"{what}={name}: no such path{hint}, and not a Hugging Face Hub id (expected a checkpoint "
            "directory, a .gguf file, or ORG/NAME[@REVISION])"
        )


def _commit_of(local: Path) -> str:
    """The commit of a path inside a cached snapshot (`.../models--ORG--NAME/snapshots/COMMIT/...`)."""
    parts = local.parts
    repo = next(i for i, part in enumerate(parts) if part.startswith(("models--", "datasets--")))
    return parts[repo + 2]


def _fetch(
    kind: str, repo: str, revision: str | None, file: str | None, what: str, name: str, hint: str
) -> str:
    """The cached path of a model snapshot or a dataset file, found or fetched once a process (a failure
    is not kept): a run that names it twice (checked before its directory is made, then loaded) sees one
    commit, with one Hub request; its pinned form (`@COMMIT`) is then found without another."""
    from huggingface_hub import constants
    from huggingface_hub.errors import EntryNotFoundError

    cache = constants.HF_HUB_CACHE
    key = (kind, repo, revision, file, cache)
    if key not in _resolved:
        try:
            local = _download(kind, repo, revision, file, cache)
        except (OSError, ValueError, EntryNotFoundError) as err:  # the Hub's errors and the cache's
            raise _missing(kind, repo, revision, file, what, name, cache, err, hint) from None
        if kind == "model":  # checked once, as it was fetched; a failure is not kept either
            _check_snapshot(Path(local), what, name)
        _resolved[key] = _resolved[(kind, repo, _commit_of(Path(local)), file, cache)] = local
    return _resolved[key]


def _download(kind: str, repo: str, revision: str | None, file: str | None, cache: str) -> str:
    """`huggingface_hub`'s own lookup: the cache offline, else the Hub (files already cached are not fetched
    again), with its progress bars on while it runs (a run turns library bars off)."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    quiet = are_progress_bars_disabled()
    if not constants.HF_HUB_OFFLINE:
        enable_progress_bars()
    try:
        if kind == "dataset":
            return hf_hub_download(repo, file, repo_type="dataset", revision=revision, cache_dir=cache)
        return snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=CHECKPOINT_FILES)
    finally:
        if quiet:
            disable_progress_bars()


def _missing(kind, repo, revision, file, what, name, cache, err, hint) -> HubError:
    how = f"hf download {repo}" + (" --repo-type dataset" if kind == "dataset" else "")
    how += f" {file}" if file else ""
    how += f" --revision {revision}" if revision else ""
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    local = "" if kind == "dataset" else f"; no local path of that name either{hint}. As a Hub id:"
    broke = " A download of it broke off before:" if _broken_off(kind, repo, cache) else ""
    return HubError(
        f"{what}={name}: not in the Hugging Face cache ({cache}) and not fetched ({reason}){local}"
        f"{broke} fetch it with `{how}` where the Hub is reachable, then run again"
    )


def _broken_off(kind: str, repo: str, cache: str) -> bool:
    """Whether the cache holds a file of `repo` that `huggingface_hub` began and did not finish."""
    blobs = Path(cache) / f"{kind}s--{repo.replace('/', '--')}" / "blobs"
    return blobs.is_dir() and any(blobs.glob("*.incomplete"))


def _check_snapshot(snapshot: Path, what: str, name: str) -> None:
    """A model snapshot holds its config and every weights file its index names (a download that broke
    off leaves finished files only): else a HubError saying which file is missing."""
    needed = ["config.json"]
    index = snapshot / WEIGHTS_INDEX
    if index.is_file():
        needed += sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    elif not any(snapshot.glob("*.safetensors")):
        needed.append("model.safetensors")
    lacking = [file for file in needed if not (snapshot / file).is_file()]
    if lacking:
        repo = name.partition("@")[0]
        raise HubError(
            f"{what}={name}: its snapshot {snapshot} has no {lacking[0]} (a download that broke off, or a "
            f"repo without safetensors weights); fetch it again with `hf download {repo}` where the Hub is "
            "reachable"
        )
