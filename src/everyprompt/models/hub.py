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


def resolve_model(name: str | Path, what: str = "model") -> Path:
    """The local path of a model named `name` (`what`: the key or option that named it, for messages): the
    Hub id's snapshot for a name shaped like one that is not a local path, else `name` itself (a path,
    which its loader checks and names if it is not a checkpoint)."""
    path = Path(name)
    parsed = None if path.exists() else hub_id(str(name))
    return path if parsed is None else Path(_snapshot(*parsed, what=what))


def is_hub_name(name: str | Path) -> bool:
    """Whether `name` would be resolved as a Hub id (shaped like one, and no local path)."""
    return not Path(name).exists() and HUB_ID.fullmatch(str(name)) is not None


def _snapshot(repo: str, revision: str | None, what: str) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    named = repo if revision is None else f"{repo}@{revision}"
    try:
        return snapshot_download(repo, revision=revision, allow_patterns=CHECKPOINT_FILES)
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
        how = f"hf download {repo}" + ("" if revision is None else f" --revision {revision}")
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise HubError(
            f"{what}={named}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and not fetched "
            f"({reason}); no local path of that name either. As a Hub id: fetch it with `{how}` where the "
            "Hub is reachable, then run again"
        ) from None
