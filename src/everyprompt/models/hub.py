"""Models by their Hugging Face Hub names: the one resolver that turns a model's name into a local path.

A name that exists on this machine (a directory, a .gguf file) is used as it is, whatever its shape. Else a
name shaped `ORG/NAME` or `ORG/NAME@REVISION` is a Hub id: its snapshot is taken from the standard Hugging
Face cache, or fetched into it with `huggingface_hub` (the files a checkpoint loads from: config, weights,
tokenizer, chat template; not other formats' weights), and everything after this sees that directory.
Offline (`HF_HUB_OFFLINE=1`, or the Hub out of reach) a cached snapshot serves; an id the cache lacks is an
`InputError` naming the id, the cache and the command that fetches it. A download that broke off is left as
`huggingface_hub` leaves it: its snapshot is not complete, so it is not used.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from everyprompt.errors import InputError

# ORG/NAME with the characters the Hub allows, then an optional @REVISION (a branch, a tag or a commit)
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>.*))?")
# what a checkpoint directory loads from (AutoModel, AutoTokenizer, chat templates)
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]


class HubError(InputError):
    """A model name that is neither a local path nor a Hub id this machine has or can fetch."""


def hub_id(name: str) -> tuple[str, str | None] | None:
    """(repo, revision or None) of a name shaped like a Hub id, or None; HubError for an empty revision."""
    match = HUB_ID.fullmatch(name)
    if match is None:
        return None
    revision = match["revision"]
    if revision is not None and not revision.strip():
        raise HubError(f"{name}: an empty revision after '@' (expected ORG/NAME@BRANCH, TAG or COMMIT)")
    return match["repo"], revision


def is_hub_name(name: str | Path) -> bool:
    """Whether `name` is resolved as a Hub id: shaped like one, and no local path."""
    return not Path(name).exists() and hub_id(str(name)) is not None


def resolve_model(name: str | Path, what: str = "model") -> Path:
    """The local path of a model named `name` (`what`: the key or option that named it, for messages): the
    Hub id's snapshot for a name shaped like one that is not a local path, else `name` itself (a path,
    which its loader checks and names if it is not a checkpoint)."""
    if not is_hub_name(name):
        return Path(name)
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, revision = hub_id(str(name))
    cache = constants.HF_HUB_CACHE
    try:
        return Path(_snapshot(repo, revision, cache))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
        how = f"hf download {repo}" + ("" if revision is None else f" --revision {revision}")
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise HubError(
            f"{what}={name}: not in the Hugging Face cache ({cache}) and not fetched ({reason}); no local "
            f"path of that name either. As a Hub id: fetch it with `{how}` where the Hub is reachable, then "
            "run again"
        ) from None


@functools.cache
def _snapshot(repo: str, revision: str | None, cache: str) -> str:
    """The snapshot of `repo` at `revision` in `cache`, found or fetched once a process (a failure is not
    kept): a run that names it twice (checked before its directory is made, then loaded) sees one commit,
    with one Hub request."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=CHECKPOINT_FILES)
