"""GGUF files as models: a `.gguf` file (llama.cpp's format, in which the package index ships real chat
models) loads like a checkpoint directory. Its weights are dequantised to float32 (the training dtype
casts from there), its tokenizer and chat template come from the file's metadata, and `convert` writes
it out as a safetensors checkpoint that loads like any Hugging Face directory (docs/models.md).

transformers does the reading (`from_pretrained(..., gguf_file=...)`, with the `gguf` package); what is
added here is the refusal of a bad file by name (missing, truncated, not GGUF, an architecture or a
quantisation transformers cannot read) and a model that can be saved again (the GGUF quantizer marker is
dropped once the weights are dequantised).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from unittest.mock import patch

import torch

from everyprompt.errors import InputError
from everyprompt.run.files import check_new_dir, write_dir_atomic

SUFFIX = ".gguf"
MAGIC = b"GGUF"


class GGUFError(InputError):
    """A GGUF file that cannot be used; the message names the file and what was wrong."""


def is_gguf(path: str | Path) -> bool:
    """`path` names a GGUF file (by its suffix; whether it is a good one is `load_gguf`'s to say)."""
    return Path(path).suffix.lower() == SUFFIX


def check_file(path: Path) -> None:
    """GGUFError unless `path` is a file that starts as a GGUF file does."""
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with {MAGIC!r})")


def _architecture(path: Path) -> str:
    """The file's `general.architecture`; GGUFError when the header or tensor table cannot be read."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except KeyError:
        raise GGUFError(f"{path}: its metadata has no general.architecture") from None
    except (ValueError, OSError, IndexError, MemoryError) as err:  # the reader raises these on a short file
        raise GGUFError(
            f"{path}: cannot be read, truncated or damaged ({type(err).__name__}: {err})"
        ) from None


def load_gguf(path: str | Path, model_class=None):
    """(model in float32, tokenizer with the file's chat template; pad = eos when it has none)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    path = Path(path)
    check_file(path)
    architecture = _architecture(path)
    known = {a.replace("_", "") for a in GGUF_SUPPORTED_ARCHITECTURES}
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES and architecture.replace("_", "") not in known:
        raise GGUFError(
            f"{path}: architecture {architecture!r} is not one transformers reads from GGUF "
            f"(it reads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})"
        )
    model_class = model_class or AutoModelForCausalLM
    try:
        # transformers' GGUF reader draws a tqdm bar of its own, out of reach of its disable_progress_bar
        with patch.object(gguf_utils, "tqdm", partial(gguf_utils.tqdm, disable=True)):
            model = model_class.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32, local_files_only=True
            )
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except NotImplementedError as err:  # gguf's dequantize: a quantisation type it does not implement
        raise GGUFError(f"{path}: a quantisation type this gguf package cannot dequantise ({err})") from None
    except (ValueError, OSError, KeyError, IndexError) as err:
        raise GGUFError(f"{path}: cannot be loaded ({type(err).__name__}: {err})") from None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the weights are plain float32 now: let the model be saved again
        quantizer.remove_quantization_config(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def convert(path: str | Path, out_dir: str | Path) -> Path:
    """Write the GGUF model at `path` as a safetensors checkpoint (model, tokenizer, chat template) into
    `out_dir`, which must not exist or be empty. Written into a temporary directory beside it and renamed:
    a failure or a kill leaves no half-written `out_dir`."""
    check_new_dir(out_dir, GGUFError)  # before the file is read
    model, tokenizer = load_gguf(path)

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    return write_dir_atomic(out_dir, write, GGUFError)
