"""Shared fixtures: a very small model and config so that the whole suite runs in minutes on 2 cores."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

os.environ["HF_HUB_OFFLINE"] = "1"  # tests never reach the Hub: a test that needs a Hub id builds a cache
if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker per core (`make test`): one thread each, children too
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

from everyprompt.config import Config, ModelConfig, load_config
from everyprompt.models import load_model_and_tokenizer

TINY_OVERRIDES = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_experts=4",
    "model.moe_intermediate_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "data.num_train=64",
    "data.num_eval=10",
    "sft.steps=2",
    "sft.batch_size=8",
    "rl.steps=2",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "rl.micro_batch_size=2",
    "rl.mini_batches=2",
    "rollout.max_new_tokens=12",
    "eval.num_samples=2",
    "eval.pass_k=2",
    "checkpoint.every=1",
    "logging.progress=false",
]


# what the clock, the kernel and the load (cpu/) measure, never what a run computed
MEASURED = ("time/", "memory/", "cpu/")
MEASURED_ENDINGS = ("_s", "_ms", "per_s", "occupancy")


def computed_figures(run_dir) -> list[dict]:
    """A run's `metrics.jsonl` rows without the figures that differ between two runs of the same
    computation (timings, memory): what two runs of one seed must agree on bit for bit."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in row.items() if not k.startswith(MEASURED) and not k.endswith(MEASURED_ENDINGS)}
        for row in rows
    ]


# the layer stack of the tiny transformers models that tests build directly from a transformers config
TINY_LAYERS = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


# the base of tests that build their config: the synchronous loop with the engine's log-probs as the old
# policy's, so that each test names the mechanism it exercises (the demo's asynchronous default runs in
# the CLI tests, which use TINY_OVERRIDES alone, and in tests/trainer/test_asynchrony.py); and a reward
# under which every group carries signal (a random tiny model scores 0 on the math reward everywhere, and
# a step without signal makes no update), unless a test names its own
SYNCHRONOUS = [
    "rl.max_staleness=0",
    "rl.old_logprobs=rollout",
    "rl.rollout_correction.mode=null",
    "rewards.function=tests.trainer.flaky_reward:scattered",
]


def tiny_config(*extra: str) -> Config:
    return load_config(None, [*TINY_OVERRIDES, *SYNCHRONOUS, *extra])


@pytest.fixture
def tiny_model():
    """A random-init 2-layer Qwen3-MoE (4 experts, top-2) with the char tokenizer, router weights randomised."""
    return make_tiny_model()


def make_tiny_model():
    """`tiny_model`'s model and tokenizer (for fixtures of a wider scope)."""
    config = ModelConfig(
        hidden_size=32, num_layers=2, num_experts=4, moe_intermediate_size=32, num_heads=2, num_kv_heads=1
    )
    model, tokenizer = load_model_and_tokenizer(config, seed=0)
    with torch.no_grad():  # make weights larger than the init so that outputs vary by token
        generator = torch.Generator().manual_seed(0)
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.eval()
    return model, tokenizer


# property tests: a quick default for `make test`; HYPOTHESIS_PROFILE=thorough for 1000+ examples a property
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("default", max_examples=100, deadline=None)
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _no_rollout_thread_outlives_its_test():
    """An asynchronous run's producer thread ends with its run, whatever way the run ended."""
    import threading
    import time

    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not any(t.name == "everyprompt-rollout" for t in threading.enumerate()):
            return
        time.sleep(0.05)
    raise AssertionError("an asynchronous run's rollout thread outlived the test that started it")


def pytest_collection_modifyitems(config, items):
    """With pytest-xdist (`-n 2 --dist loadgroup`), the tests of tests/distributed run on one worker, one
    after the other: they share one local Ray instance and count Ray's processes on the whole machine."""
    ray_tests = pytest.mark.xdist_group("ray")
    for item in items:
        if "distributed" in item.path.parts:
            item.add_marker(ray_tests)


def cache_repo(
    cache: Path, repo: str, source: Path, commit: str, branch: str | None = "main", kind: str = "model"
) -> Path:
    """`source`'s files as snapshot `commit` of the model (or dataset) `repo` in a Hugging Face cache, in
    the layout `huggingface_hub` writes: `models--ORG--NAME/{blobs, refs/BRANCH, snapshots/COMMIT/...}`,
    each snapshot file a link to its blob (and `branch` pointing at the commit)."""
    root = cache / f"{kind}s--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    for file in sorted(source.rglob("*")):
        if file.is_file():
            data = file.read_bytes()
            blob = root / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = snapshot / file.relative_to(source)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    if branch is not None:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / branch).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache under tmp_path, the Hub offline (as every test is)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


class ProductDtypes(TorchDispatchMode):
    """Records the dtype of every matrix product that reaches torch's kernels."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def one_line_error(capsys, argv: list[str]) -> str:
    """The one line `everyprompt ARGV` prints when it exits 2 (bad input): no traceback, nothing else."""
    from everyprompt.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]
