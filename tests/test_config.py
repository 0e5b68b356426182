import re
from pathlib import Path

import pytest
import torch
import yaml

from everyprompt.cli import main
from everyprompt.config import Config, ConfigError, demo_config_path, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_demo_config_is_embedded_and_valid():
    config = load_config()
    assert demo_config_path().is_file()
    assert config.rl.loss == "ppo_clip"
    assert config.model.preset == "tiny-moe"


def test_every_field_has_a_description():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description or isinstance(field.default_factory, type), f"{model.__name__}.{name}"
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, Config.__mro__[1]):
                walk(annotation)

    walk(Config)


def test_dotted_overrides_are_parsed_as_yaml():
    config = load_config(None, ["rl.lr=1e-4", "data.levels=[1,2]", "logging.progress=false"])
    assert config.rl.lr == pytest.approx(1e-4)
    assert config.data.levels == [1, 2]
    assert config.logging.progress is False


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("rl.lrr=1", "rl.lrr"),
        ("nope=1", "nope"),
        ("rl.lr=abc", "rl.lr"),
        ("rl.group_size=1", "rl.group_size"),
        ("kept_block_mib=0", "kept_block_mib"),
        ("kept_block_mib=2048", "kept_block_mib"),
    ],
)
def test_bad_override_names_the_key(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(None, [override])


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"rl": {"learning_rate": 0.1}}))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "rl.learning_rate" in str(err.value) and str(path) in str(err.value)


def test_invalid_yaml_names_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("rl:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:\d+"):
        load_config(path)


@pytest.mark.parametrize(("args", "named"), [(["rl.bogus=3"], "rl.bogus"), (["rl.steps=many"], "rl.steps")])
def test_cli_config_error_exits_2_with_one_line(args, named, capsys):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_pass_k_above_samples_is_rejected():
    with pytest.raises(ConfigError, match="pass_k"):
        load_config(None, ["eval.num_samples=2", "eval.pass_k=4"])


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "rl.loss=ppo",
            "config key 'rl.loss': expected one of cispo, dppo_kl, dppo_tv, espo, gspo, gspo_token, ppo_clip, sapo",
        ),
        ("rl.advantage=gae", "config key 'rl.advantage': expected one of dr_grpo, gdpo, grpo, rloo"),
        ("rl.espo.high_frac=1.5", "config key 'rl.espo.high_frac'"),
        ("rl.espo.alpha=0", "config key 'rl.espo.alpha'"),
        ("rl.kl.estimator=k4", "config key 'rl.kl.estimator'"),
        ("rl.rollout_correction.cap=0.5", "config key 'rl.rollout_correction.cap'"),
        ("rl.loss_agg=sum", "config key 'rl.loss_agg'"),
    ],
)
def test_algorithm_options_are_validated(override, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, [override])


def test_rollout_old_logprobs_cannot_be_corrected_against_themselves():
    with pytest.raises(ConfigError, match=r"config section 'rl': .*set rl.old_logprobs=recompute$"):
        load_config(None, ["rl.old_logprobs=rollout", "rl.rollout_correction.mode=tis"])


def test_a_rule_across_sections_is_reported_without_an_empty_section_name():
    with pytest.raises(
        ConfigError, match=r"yaml: config: rl.old_logprobs=rollout .*set rl.old_logprobs=recompute$"
    ):
        load_config(
            None,
            [
                "rl.max_staleness=0",
                "rl.rollout_correction.mode=null",
                "rl.old_logprobs=rollout",
                "rollout.precision=fp8",
            ],
        )


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("zve.reshape.length_coef=0.96", "or a wrong answer could outrank a right one"),
        ("zve.filter.low=1", "low (1.0) must be below high (1.0)"),
        (
            "curriculum.stages=[{mixture: {4: -1}}]",
            "'curriculum.stages.0.mixture': expected non-negative weights",
        ),
        (
            "curriculum.stages=[{mixture: {4: 1}, overrides: {rl.lr: 1}}]",
            "unknown stage override(s) ['rl.lr']",
        ),
        ("zve.expansion.max_group_size=1", "config key 'zve.expansion.max_group_size'"),
    ],
)
def test_zve_and_curriculum_options_are_validated(override, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, [override])


def test_dead_zone_needs_a_centred_estimator():
    assert load_config(None, ["rl.dead_zone=0.1"]).rl.dead_zone == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="dead_zone applies to the grpo and dr_grpo estimators"):
        load_config(None, ["rl.dead_zone=0.1", "rl.advantage=rloo"])
    with pytest.raises(ConfigError, match=r"rl\.dead_zone"):
        load_config(None, ["rl.dead_zone=-1"])


def test_an_invalid_value_names_where_it_came_from(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 1\nrl:\n  steps: 3\n  lr: -1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}:4: config key 'rl.lr'")  # the file, and the key's line
    with pytest.raises(ConfigError) as err:  # the same key given on the command line: the override is named
        load_config(path, ["rl.lr=-2"])
    assert str(err.value).startswith("command-line override 'rl.lr=-2': config key 'rl.lr'")
    with pytest.raises(ConfigError) as err:  # an override of the embedded default never blames demo.yaml
        load_config(None, ["eval.num_samples=-1"])
    assert "demo.yaml" not in str(err.value) and "'eval.num_samples=-1'" in str(err.value)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path):
    """Each recipe in configs/ loads as shipped (model paths need not exist to validate)."""
    config = load_config(path)
    assert config.rl.steps > 0 and (config.model.path or config.model.preset)


def test_sleep_while_training_auto_keeps_an_engine_with_cuda_graphs_awake():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    auto = load_config(None, []).rollout
    assert auto.sleep_while_training == "auto"
    assert auto.sleeps(cpu) and not auto.sleeps(cuda)  # graphs (auto) on CUDA: kept, not recaptured
    assert load_config(None, ["rollout.cuda_graphs=off"]).rollout.sleeps(cuda)
    assert load_config(None, ["rollout.sleep_while_training=true"]).rollout.sleeps(cuda)
    assert not load_config(None, ["rollout.sleep_while_training=false"]).rollout.sleeps(cpu)
    with pytest.raises(ConfigError, match="rollout.sleep_while_training"):
        load_config(None, ["rollout.sleep_while_training=sometimes"])


@pytest.mark.parametrize("value", ["0", "-3", "big", "true", "1.5"])
def test_a_micro_batch_size_is_a_positive_integer_or_auto(value):
    with pytest.raises(
        ConfigError, match=re.escape("config key 'rl.micro_batch_size': expected a positive integer or auto")
    ):
        load_config(None, [f"rl.micro_batch_size={value}"])


def test_auto_micro_batches_are_16_sequences_on_the_cpu_and_a_token_budget_on_a_gpu():
    from everyprompt.config.rl import AUTO_CPU_SEQUENCES, AUTO_GPU_TOKENS

    auto = load_config(None, ["rl.micro_batch_size=auto"]).rl
    assert auto.micro_batching("cpu") == (AUTO_CPU_SEQUENCES, None) == (16, None)
    assert auto.micro_batching("cuda") == (None, AUTO_GPU_TOKENS) == (None, 8192)
    capped = load_config(None, ["rl.micro_batch_size=auto", "rl.micro_batch_tokens=4096"]).rl
    assert capped.micro_batching("cuda") == (None, 4096) and capped.micro_batching("cpu") == (16, 4096)
    fixed = load_config(None, ["rl.micro_batch_size=8"]).rl
    assert fixed.micro_batching("cpu") == fixed.micro_batching("cuda") == (8, None)
