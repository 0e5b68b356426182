"""`model.kernels=liger` (models/liger.py): Liger's Triton kernels run on CUDA only, with the extra
installed; anything else stops the run before any work, naming the key. Their values are a `gpu` test's
(tests/gpu/test_cuda.py)."""

import sys

import pytest
import torch

from everyprompt.cli import main
from everyprompt.config import ConfigError, load_config
from everyprompt.models.kernels import KernelsError, check_kernels
from tests.conftest import TINY_OVERRIDES


def test_liger_on_the_cpu_exits_2_before_any_work(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *TINY_OVERRIDES, "model.kernels=liger", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "config key 'model.kernels'" in err and "CUDA" in err and "Traceback" not in err
    assert not run_dir.exists() or not any(run_dir.iterdir())  # nothing written: no work began


def test_liger_without_the_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # an import of it fails, as when absent
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    with pytest.raises(KernelsError, match=r"pip install 'everyprompt\[kernels\]'"):
        check_kernels("liger", torch.device("cuda", 0))


def test_an_unknown_kernel_choice_names_the_key():
    with pytest.raises(ConfigError, match=r"model\.kernels"):
        load_config(None, ["model.kernels=triton"])
