"""`everyprompt upcycle`: a dense Llama into a Mixtral MoE with the dense model's logits at initialisation."""

import json

import pytest
import torch

from everyprompt.cli import main
from everyprompt.config import RolloutConfig
from everyprompt.models.io import load_pretrained
from everyprompt.rollout import GenerationRequest, SamplingParams, build_engine
from tests.families import save_family_checkpoint


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return save_family_checkpoint("llama", tmp_path_factory.mktemp("dense") / "llama", attention_bias=False)


def test_the_upcycled_moe_has_the_dense_logits_and_decodes_the_same(dense, tmp_path, capsys):
    out = tmp_path / "moe"
    assert main(["upcycle", str(dense), str(out), "--experts", "8", "--top-k", "2"]) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (8, 2)
    base, tokenizer = load_pretrained(dense)
    moe, moe_tokenizer = load_pretrained(out)  # transformers reads it back as a Mixtral
    assert moe_tokenizer.get_vocab() == tokenizer.get_vocab()
    ids = torch.randint(0, base.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, base(ids).logits, atol=1e-5, rtol=0)
    # the routers are not a tie: tokens spread over the experts from the start
    router = moe.model.layers[0].mlp.gate.weight
    assert router.abs().max() > 0 and router.std() > 0
    # the native engine runs the upcycled model and decodes what the dense model decodes
    requests = [GenerationRequest(i, [1, 5 + i, 9, 3], seed=i) for i in range(4)]
    params = SamplingParams(8, greedy=True)
    texts = []
    for model in (base, moe):
        engine = build_engine(RolloutConfig(engine="native"), model.eval(), tokenizer)
        texts.append(sorted((c.request_id, c.token_ids) for c in engine.generate(requests, params)))
    assert texts[0] == texts[1]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--experts", "4", "--top-k", "5"], "--top-k 5"),
        (["--experts", "4", "--top-k", "0"], "--top-k 0"),
    ],
)
def test_bad_upcycle_arguments_exit_2(dense, tmp_path, capsys, argv, named):
    assert main(["upcycle", str(dense), str(tmp_path / "moe"), *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert not (tmp_path / "moe").exists()  # nothing half-written


def test_an_moe_a_biased_model_or_a_full_output_directory_is_refused(tmp_path, capsys):
    moe = save_family_checkpoint("qwen3_moe", tmp_path / "qwen3moe")
    assert main(["upcycle", str(moe), str(tmp_path / "out")]) == 2
    assert f"{moe}: model_type 'qwen3_moe' cannot be upcycled" in capsys.readouterr().err
    biased = save_family_checkpoint("llama", tmp_path / "biased", attention_bias=True)
    assert main(["upcycle", str(biased), str(tmp_path / "out")]) == 2
    assert "has biases" in capsys.readouterr().err and not (tmp_path / "out").exists()
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("user data")
    assert main(["upcycle", str(moe), str(full)]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert (full / "keep.txt").read_text() == "user data"


def test_a_checkpoint_directory_without_weights_exits_2_naming_it(dense, tmp_path, capsys):
    import shutil

    empty = tmp_path / "no-weights"
    shutil.copytree(dense, empty, ignore=shutil.ignore_patterns("*.safetensors"))
    for argv in (["eval", str(empty), "eval.num_samples=0"], ["upcycle", str(empty), str(tmp_path / "out")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
        assert f"{empty}: cannot load the checkpoint" in err[0] and "model.safetensors" in err[0]
    assert not (tmp_path / "out").exists()
