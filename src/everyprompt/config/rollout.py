"""Config sections of the rollout engine and the rewards."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from everyprompt import devices
from everyprompt.choices import GRAPH_BUCKETS, Decoding, check_buckets, decoding, engine_choices
from everyprompt.config.base import YAML_WORDS, Section
from everyprompt.devices import check_device_setting


class RolloutConfig(Section):
    engine: str = Field(
        "auto",
        description="Rollout engine: `native` (own decode path, the fast one; families in docs/models.md), "
        "`hf` (any transformers causal LM through its own forward), or `auto` (native where it runs the "
        "model, else hf; the choice is logged).",
    )
    precision: Literal["fp32", "bf16", "fp8"] = Field(
        "fp32",
        description="Rollout engine arithmetic: fp32, bf16, or fp8 (native engine only: e4m3 projection "
        "weights with per-output-channel scales, re-quantised at every weight sync).",
    )
    compile: Annotated[Literal["auto", "on", "off"], YAML_WORDS] = Field(
        "auto",
        description="Native engine: run the decode step through torch.compile (`on`), eager (`off`), or "
        "compile once eager decoding has cost about what a compile does (`auto`; docs/rollout.md).",
    )
    cuda_graphs: Annotated[Literal["auto", "on", "off", "static"], YAML_WORDS] = Field(
        "auto",
        description="Native engine: its decode step captured as CUDA graphs, one per batch bucket (`auto`: on a "
        "CUDA device; `on`: a CUDA device is required; `off`; `static`: the graphs' step run without capture, "
        "on any device, to tell a graph's fault from the step's). With compile=on the graphs capture the "
        "step's compiled bodies (docs/gpu.md).",
    )
    graph_buckets: list[int] = Field(
        default_factory=lambda: list(GRAPH_BUCKETS),
        description="Batch sizes (increasing) the CUDA-graph step is captured at; a step runs padded to the "
        "next one, eagerly above the largest (default 1, 2, 4, 8, then every 16 to 512).",
    )
    device: str = Field(
        "auto",
        description="Where the native engine keeps its weights, KV cache and decoding state: auto (CUDA when "
        "torch sees it, else the CPU), cpu, cuda, or cuda:N (docs/gpu.md).",
    )
    sleep_while_training: bool | Literal["auto"] = Field(
        "auto",
        description="Synchronous runs: the engine frees its weights and KV cache while the learner updates "
        "and takes them back at the weight sync (docs/performance.md); false keeps them; auto: true unless "
        "the engine keeps CUDA graphs (a CUDA rollout device with cuda_graphs auto or on), which sleeping "
        "would drop and recapture every step.",
    )
    max_new_tokens: int = Field(64, gt=0, description="Completion length cap (tokens).")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; the trainer's log-probs use the same."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    parity_threshold: float = Field(
        1e-3,
        ge=0,
        description="Startup parity check: the largest mean |log-prob difference| (fp32) allowed between the "
        "engine and the trainer on a few completions before the first RL step; 0 turns the check off.",
    )
    parity_prompts: int = Field(4, gt=0, description="Training prompts the startup parity check samples.")
    parity_layers: Literal["auto"] | int = Field(
        "auto",
        description="Decoder layers the startup parity check runs: the model's first N (with its embeddings, "
        "final norm and head) in a float32 copy of their own; auto: the whole model when its float32 copy "
        "takes 4 GiB or less, else the first 4 (or as many as hold every kind of layer the model has).",
    )
    stop: list[str] = Field(
        default_factory=list,
        description="Strings that end a completion (finish reason `stop`), besides every end-of-sequence id "
        "of the model's tokenizer and generation config (finish reason `eos`).",
    )
    batch_size: int = Field(256, gt=0, description="Sequences decoded together (continuous-batching slots).")
    schedule: Literal["fifo", "longest_first"] = Field(
        "longest_first",
        description="Admission order into the engine: as sampled, or longest predicted completion first "
        "(prediction: the prompt's mean length in the pass-rate store, else its bucket's, else the cap).",
    )

    partial: bool = Field(
        False,
        description="Partial rollouts: a sequence generates at most `partial_tokens` tokens per step; an "
        "unfinished one continues in the next step under the newer weights (docs/asynchrony.md).",
    )
    partial_tokens: int | None = Field(
        None, gt=0, description="Tokens a sequence may generate per step with `partial` (None: half the cap)."
    )
    max_versions_per_sequence: int = Field(
        2,
        ge=2,
        description="With `partial`: the most policy versions (steps) one sequence may span; in its last one "
        "it runs to its end.",
    )

    @field_validator("device")
    @classmethod
    def _a_device_setting(cls, value: str) -> str:
        return check_device_setting(value)

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        return _known_engine(name)

    @field_validator("parity_layers")
    @classmethod
    def _some_layers(cls, value: str | int) -> str | int:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"must be auto or a number of layers, 1 or more; got {value}")
        return value

    @field_validator("graph_buckets")
    @classmethod
    def _increasing_buckets(cls, buckets: list[int]) -> list[int]:
        return list(check_buckets(buckets))

    @model_validator(mode="after")
    def _decoding_settings_agree(self) -> RolloutConfig:
        # the device is known here only when it is the CPU (auto and cuda resolve where the engine is made)
        decoding(self.compile, self.cuda_graphs, "cpu" if self.device == "cpu" else "cuda")
        return self

    def decoding(self, device=None) -> Decoding:
        """How the native engine decodes on `device` (by default `device` resolved): choices.decoding."""
        device = device or devices.resolve_device(self.device, "rollout.device")
        return decoding(self.compile, self.cuda_graphs, device.type)

    def sleeps(self, device=None) -> bool:
        """Whether the engine sleeps while the learner trains, on `device` (by default `device` resolved):
        under `auto`, unless it decodes with CUDA graphs (sleeping would drop them)."""
        if self.sleep_while_training != "auto":
            return self.sleep_while_training
        return not self.decoding(device).graphs

    def segment_tokens(self) -> int:
        """With `partial`: the tokens a sequence generates per step."""
        return self.partial_tokens or max(self.max_new_tokens // 2, 1)


def _known_engine(name: str) -> str:
    if name not in engine_choices():
        raise ValueError(f"expected one of {', '.join(engine_choices())}")
    return name


DEFAULT_JUDGE_TEMPLATE = (
    "You are grading a response against a reference answer.\n"
    "Question: {question}\nReference answer: {reference}\nResponse: {response}\n"
    "Think step by step, then end with one line: Verdict: correct, Verdict: partial or Verdict: incorrect.\n"
)


class EnvConfig(Section):
    name: str | None = Field(
        None,
        description="Multi-turn episodes: the environment every RL prompt runs in (a registered name, e.g. "
        "`calculator`; docs/environments.md). Its first messages replace the prompt's formatting and its "
        "reward replaces `rewards`. None: single-turn completions.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options of the environment (calculator: max_calls, example).",
    )
    max_turns: int = Field(8, ge=1, description="Model turns an episode may take; it ends after the last.")
    turn_rewards: Annotated[Literal["last", "sum", "turn"], YAML_WORDS] = Field(
        "last",
        description="How the rewards an environment gives its turns make the episode's reward: the last one "
        "given (an environment that judges at the end), or their sum (one that rewards each turn); turn: "
        "step-wise episodes only, each turn's row trained on its own turn's reward (a turn given none: 0), "
        "its advantage within the group's turns.",
    )
    trajectory: Literal["auto", "contiguous", "stepwise"] = Field(
        "auto",
        description="How an episode trains: contiguous (one growing sequence, the environment's tokens fed "
        "between the model's turns and masked out), stepwise (one sample per model turn, its prompt the whole "
        "conversation as the chat template renders it: for templates that rewrite earlier turns, such as "
        "reasoning models' that drop past thinking), or auto: contiguous where the template extends each "
        "rendering, else stepwise (docs/environments.md).",
    )
    time_limit_s: float | None = Field(
        60.0,
        gt=0,
        description="Seconds the environment may take to answer one model turn; past them its episode ends "
        "with a recorded error (no reward) and the run goes on. None: no limit.",
    )
    stepwise_schedule: Literal["auto", "continuous", "rounds"] = Field(
        "auto",
        description="How step-wise episodes' turns are scheduled: continuous (each episode's next turn joins "
        "the running generate call as soon as its environment answers: no episode waits for another's turn "
        "or environment; needs an engine that takes requests while a call runs, the native one), rounds "
        "(every episode's turn t, then every environment, then turn t + 1), or auto: continuous where the "
        "engine can, else rounds. Both sample the same turns (docs/environments.md).",
    )


class ExternalConfig(Section):
    enabled: bool = Field(
        False,
        description="An outside program drives the rollouts: it generates through the run's OpenAI-compatible "
        "endpoint and posts scored groups to /v1/rollouts; each RL step trains on the next "
        "rl.prompts_per_step groups (docs/serving.md).",
    )
    host: str = Field("127.0.0.1", description="Address the run's endpoint listens on (beyond this machine: "
                      "$EVERYPROMPT_API_KEY must be set).")  # fmt: skip
    port: int = Field(
        8000, ge=0, le=65535, description="Port of the run's endpoint (0: any free port, printed)."
    )
    wait_s: float = Field(
        600.0, gt=0, description="Seconds a step waits for its groups before the run stops."
    )
    max_prompt_tokens: int = Field(1024, ge=1, description="Longest prompt the endpoint accepts (tokens).")


class GenRMConfig(Section):
    model: str | None = Field(
        None, description="Judge: a causal-LM checkpoint directory or Hub id ORG/NAME[@REVISION]."
    )
    template: str = Field(
        DEFAULT_JUDGE_TEMPLATE,
        description="Judge prompt; {question}, {reference} and {response} are filled from the prompt row's "
        "`prompt` and `answer` and the completion.",
    )
    values: dict[str, float] = Field(
        default_factory=dict,
        description="Reward per verdict (correct/partial/incorrect/better/tie/worse); unset ones keep "
        "+1 / 0 / -1.",
    )
    max_new_tokens: int = Field(256, gt=0, description="Judge output cap (reasoning + verdict).")
    greedy: bool = Field(True, description="Greedy judging (else sampled at `temperature`).")
    temperature: float = Field(1.0, gt=0, description="Judge sampling temperature when not greedy.")
    batch_size: int = Field(64, gt=0, description="Judge engine slots.")
    engine: str = Field("auto", description="Rollout engine that decodes the judge (as `rollout.engine`).")
    log_every: int = Field(
        16,
        ge=0,
        description="Write every n-th judged row (prompt, output, verdict) to genrm_samples.jsonl (0: off).",
    )

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        return _known_engine(name)


class ScalarRMConfig(Section):
    model: str | None = Field(
        None,
        description="A sequence-classification checkpoint with one output (the score): a directory or a Hub id.",
    )
    template: str = Field("{question}\n{response}", description="Text scored; {question} and {response}.")
    batch_size: int = Field(32, gt=0, description="Responses scored per forward pass.")


class RewardComponentConfig(Section):
    name: str = Field(..., description="Component name: logged as reward/<name>.")
    function: str = Field(..., description="Registered reward name, `package.module:function`, or `genrm`.")
    weight: float = Field(1.0, description="Weight of this component in the total.")


class RewardsConfig(Section):
    function: str = Field(
        "auto",
        description="Registered reward name, `package.module:function`, `genrm` (a judge model) or "
        "`scalar_rm` (a sequence-classification reward model); auto: `reasoning_gym` (each task's own "
        "scorer) when data.task=reasoning-gym, else `math`.",
    )
    genrm: GenRMConfig = Field(default_factory=GenRMConfig, description="The judge of `function: genrm`.")
    scalar_rm: ScalarRMConfig = Field(
        default_factory=ScalarRMConfig, description="The model of `function: scalar_rm`."
    )
    components: list[RewardComponentConfig] = Field(
        default_factory=list,
        description="Several weighted rewards summed (replaces `function` when given), each logged as "
        "reward/<name>.",
    )
    missing: Literal["skip", "zero"] = Field(
        "skip",
        description="A component that is None for a row: `skip` makes the row's total None, `zero` counts it 0.",
    )
    workers: int = Field(
        1,
        ge=0,
        description="Reward worker processes, fed completions as they finish (0: score inline, "
        "no overlap with generation and no time limit).",
    )
    timeout_s: float = Field(
        30.0, gt=0, description="Time limit of one reward call; past it the reward is None (an error)."
    )
    load_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Limit on a reward worker's one-time set-up (a judge loading its model), apart from the "
        "per-call timeout_s; a reward that fails to load stops the run.",
    )
    max_error_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Stop the run when more than this share of the rewards of the last `error_window` steps "
        "failed (a step whose rewards all failed stops it at once).",
    )
    error_window: int = Field(10, ge=1, description="Steps over which `max_error_fraction` is judged.")

    @model_validator(mode="after")
    def _check_functions(self) -> RewardsConfig:
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ValueError(f"components: names must be unique, got {names}")
        taken = sorted(set(names) & {"mean", "accuracy", "errors", "errors_total", "none_fraction"})
        if taken:
            raise ValueError(f"components: {taken} would clash with the reward/* metrics of the same name")
        functions = [c.function for c in self.components] or [self.function]
        if "genrm" in functions and not self.genrm.model:
            raise ValueError("function 'genrm' needs rewards.genrm.model (a judge checkpoint directory)")
        if "scalar_rm" in functions and not self.scalar_rm.model:
            raise ValueError("function 'scalar_rm' needs rewards.scalar_rm.model (a checkpoint directory)")
        return self
