"""Generative reward model (GenRM): a judge that reasons, then gives a ternary verdict (docs/rewards.md;
arXiv 2512.07710). Equal-quality responses then tie exactly and their group is zero-variance, handled by ZVE,
instead of getting random-sign advantages from a noisy scalar score.

This module holds the verdict contract: the judge is asked to end with a line `Verdict: <label>`, and
`parse_verdict` reads the last verdict it gave. Labels come in two vocabularies: reference grading
(correct / partial / incorrect) and pairwise comparison (better / tie / worse); each maps to a value
(default +1 / 0 / -1). A verdict that cannot be read is None: the row is left out of its group's
statistics and counted, never guessed.
"""

from __future__ import annotations

import re

from everyprompt.run.layout import RunLayout

# label -> canonical verdict; longer phrases first so that "partially correct" and "incorrect" are not
# read as "correct"
ALIASES: dict[str, str] = {
    "partially correct": "partial",
    "partly correct": "partial",
    "not correct": "incorrect",
    "incorrect": "incorrect",
    "wrong": "incorrect",
    "partial": "partial",
    "correct": "correct",
    "right": "correct",
    "better": "better",
    "worse": "worse",
    "tie": "tie",
    "equal": "tie",
    "same": "tie",
}
DEFAULT_VALUES: dict[str, float] = {
    "correct": 1.0,
    "partial": 0.0,
    "incorrect": -1.0,
    "better": 1.0,
    "tie": 0.0,
    "worse": -1.0,
}

_LABEL = "|".join(re.escape(a) for a in sorted(ALIASES, key=len, reverse=True))
# "Verdict: correct", "**Verdict:** [[Incorrect]]", "final verdict = tie", "\boxed{partial}"
_EXPLICIT = re.compile(
    rf"(?:verdict|judg(?:e)?ment|grade)\s*\**\s*[:=]\s*\**\s*[\[\(\"'`]*\s*({_LABEL})\b|\\boxed\{{\s*({_LABEL})\s*\}}",
    re.IGNORECASE,
)
# a last line that is nothing but a label ("Incorrect." / "[[tie]]")
_BARE_LAST_LINE = re.compile(rf"^[\s\*\[\(\"'`]*({_LABEL})[\s\*\]\)\"'`.!]*$", re.IGNORECASE)


def parse_verdict(text: str) -> str | None:
    """The canonical verdict (correct / partial / incorrect / better / tie / worse) the judge gave last,
    or None if it gave none that can be read."""
    found = [m.group(1) or m.group(2) for m in _EXPLICIT.finditer(text)]
    if found:
        return ALIASES[found[-1].lower()]
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if lines:
        bare = _BARE_LAST_LINE.match(lines[-1])
        if bare:
            return ALIASES[bare.group(1).lower()]
    return None


def verdict_value(text: str, values: dict[str, float] | None = None) -> float | None:
    """The reward of a judge output: its verdict's value (`values` overrides the defaults), or None."""
    verdict = parse_verdict(text)
    if verdict is None:
        return None
    table = {**DEFAULT_VALUES, **(values or {})}
    return table[verdict]


class GenRMJudge:
    """`fn(completions, prompt=..., answer=...) -> list[float | None]`: a judge checkpoint of any family,
    decoded by the rollout engine `engine` names (`auto`: native where it runs the judge, else hf), grades
    each completion against the row's reference answer; the completions of one call are judged together
    (the reward pool sends up to `batch_size` per call).

    The judge loads in `prepare()`, which the reward pool runs once in each worker before its first call
    (under `rewards.load_timeout_s`, not the per-call timeout), never in the trainer. Its prompt is the
    template rendered through the judge tokenizer's chat template when it has one. With `log_path`, every
    `log_every`-th judged row (prompt, raw output, verdict, value) is appended there.
    """

    def __init__(
        self,
        model: str,
        template: str,
        values: dict[str, float] | None = None,
        max_new_tokens: int = 256,
        greedy: bool = True,
        temperature: float = 1.0,
        batch_size: int = 64,
        log_path: str | None = None,
        log_every: int = 16,
        engine: str = "auto",
    ):
        self.model_path, self.template = model, template
        self.max_new_tokens, self.greedy, self.temperature = max_new_tokens, greedy, temperature
        self.batch_size, self.log_path, self.log_every = batch_size, log_path, log_every
        self.engine_name = engine
        self.judged = 0  # rows judged so far (sampling seeds, the logging cadence)
        self._engine = self._tokenizer = None
        unknown = set(values or {}) - set(DEFAULT_VALUES)
        if unknown:
            raise ValueError(
                f"rewards.genrm.values: unknown verdicts {sorted(unknown)}; known: {', '.join(DEFAULT_VALUES)}"
            )
        for field in ("{question}", "{reference}", "{response}"):
            if field not in template:
                raise ValueError(f"rewards.genrm.template has no {field} field")
        self.table = {**DEFAULT_VALUES, **(values or {})}  # verdict -> reward

    @classmethod
    def from_config(cls, config, run_dir=None) -> GenRMJudge:
        """From a `GenRMConfig`; samples go to RUN_DIR/genrm_samples.jsonl."""
        logged = run_dir is not None and config.log_every
        log_path = str(RunLayout(run_dir).genrm_samples) if logged else None
        return cls(
            config.model,
            config.template,
            config.values,
            config.max_new_tokens,
            config.greedy,
            config.temperature,
            config.batch_size,
            log_path,
            config.log_every,
            config.engine,
        )

    def prepare(self) -> None:
        """Load the judge (once; the pool calls this in each worker before the first call)."""
        if self._engine is not None:
            return
        from everyprompt.models.io import load_pretrained
        from everyprompt.rollout import make_engine

        model, self._tokenizer = load_pretrained(self.model_path)
        self._engine = make_engine(self.engine_name, model.eval(), self._tokenizer, self.batch_size)

    def prompt_ids(self, text: str) -> list[int]:
        """The judge's input: `text` as a user turn of its chat template when it has one, else as is."""
        tokenizer = self._tokenizer
        if getattr(tokenizer, "chat_template", None):
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            return tokenizer(rendered, add_special_tokens=False).input_ids
        return tokenizer(text).input_ids

    def prompts(self, completions: list[str], prompt: list, answer: list) -> list[str]:
        return [
            self.template.format(question=q, reference=a, response=c)
            for c, q, a in zip(completions, prompt, answer)
        ]

    def score_with_components(self, completions: list[str], **columns):
        """Values, plus per row `genrm_unparseable` (1 if the verdict could not be read): logged by the
        trainer as reward/genrm_unparseable."""
        values = self(completions, **columns)
        return values, [{"genrm_unparseable": float(v is None)} for v in values], []

    def __call__(self, completions: list[str], prompt: list | None = None, answer: list | None = None, **_):
        if prompt is None or answer is None:
            raise ValueError("the genrm reward needs the rows' `prompt` and `answer` fields")
        from everyprompt.rollout import GenerationRequest, SamplingParams

        self.prepare()
        texts = self.prompts(completions, prompt, answer)
        requests = [
            GenerationRequest(i, self.prompt_ids(t), seed=self.judged + i) for i, t in enumerate(texts)
        ]
        params = SamplingParams(self.max_new_tokens, temperature=self.temperature, greedy=self.greedy)
        outputs: dict[int, str] = {}
        for completion in self._engine.generate(requests, params):
            outputs[completion.request_id] = self._tokenizer.decode(
                completion.token_ids, skip_special_tokens=True
            )
        rewards = []
        for i, text in enumerate(texts):
            verdict = parse_verdict(outputs[i])
            value = None if verdict is None else self.table[verdict]
            self.judged += 1
            if self.log_path and self.log_every and self.judged % self.log_every == 0:
                self._log(
                    {"judge_prompt": text, "judge_output": outputs[i], "verdict": verdict, "reward": value}
                )
            rewards.append(value)
        return rewards

    def _log(self, record: dict) -> None:
        import json

        with open(self.log_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
