"""On-policy distillation on the learner side (`rl.teacher`, docs/algorithms.md): the teachers, loaded
on the learner's device (each learner rank loads its own under Ray), score the tokens the student sampled
where the KL reference does; their log-probs become a per-token advantage (algorithms/distill.py), alone
or added to the estimator's. Which teacher scores a row: the one teacher, or the one its prompt's
`rl.teacher.by` column names (`RolloutBatch.teacher_keys`)."""

from __future__ import annotations

import torch

from everyprompt.algorithms import distillation_advantages, distillation_metrics, distillation_sums
from everyprompt.batch import RolloutBatch
from everyprompt.config import Config, ConfigError
from everyprompt.config.teacher import TeacherConfig
from everyprompt.errors import InputError, RunError
from everyprompt.models.io import load_pretrained, load_tokenizer
from everyprompt.models.precision import forward_kernels, frozen_dtype


def teacher_key(key: str) -> str:
    """The config key that names the teacher matched by `key` ('' is the one teacher of every prompt)."""
    return "rl.teacher.model" if key == "" else f"rl.teacher.models.{key}"


def check_teachers(section: TeacherConfig, tokenizer, student: str, rows: list[dict]) -> None:
    """Each teacher's tokenizer is the student's, else a ConfigError naming both: the teacher scores the
    student's token ids, which mean the same only under one vocabulary. A teacher that does not load is a
    ConfigError naming its key; so are several teachers whose column no RL prompt row (`rows`) has, or whose
    values none has."""
    if section.by is not None and rows:  # (no rows at all: the run says so itself)
        values = {str(row[section.by]) for row in rows if row.get(section.by) is not None}
        if not values:
            columns = sorted({column for row in rows for column in row})
            raise ConfigError(
                f"config key 'rl.teacher.by': no RL prompt row has a value in column {section.by!r}; the "
                f"rows have {columns}"
            )
        if not values & set(section.models):
            raise ConfigError(
                f"config key 'rl.teacher.models': no RL prompt has a {section.by} among "
                f"{sorted(section.models)}; its values are {sorted(values)[:12]}"
            )
    vocab = tokenizer.get_vocab()
    for key, path in section.named().items():
        try:
            theirs = load_tokenizer(path).get_vocab()
        except InputError as err:
            raise ConfigError(f"config key '{teacher_key(key)}': {err}") from None
        if theirs == vocab:
            continue
        mine_by_id = {i: token for token, i in vocab.items()}
        theirs_by_id = {i: token for token, i in theirs.items()}
        first = min(
            i for i in set(mine_by_id) | set(theirs_by_id) if mine_by_id.get(i) != theirs_by_id.get(i)
        )
        raise ConfigError(
            f"config key '{teacher_key(key)}': the teacher {path}'s tokenizer ({len(theirs)} tokens) is not "
            f"the student {student}'s ({len(vocab)} tokens): token id {first} is "
            f"{theirs_by_id.get(first)!r} to the teacher and {mine_by_id.get(first)!r} to the student. "
            "Distillation scores the student's token ids under the teacher, so both need one tokenizer"
        )


def student_name(config: Config) -> str:
    return config.model.path or f"(preset {config.model.preset})"


def _load(key: str, path: str, config: Config, device: torch.device):
    try:  # read as it is held (model.frozen_dtype): never a whole float32 copy of it
        model, _ = load_pretrained(path, dtype=frozen_dtype(config.model, device))
    except InputError as err:
        raise ConfigError(f"config key '{teacher_key(key)}': {err}") from None
    return forward_kernels(model.to(device), config.model).eval().requires_grad_(False)


def _rows_of(data: dict, positions: list[int]) -> dict:
    """The tensors of a `RolloutBatch.padded` dict at rows `positions`, each indexed on its own device (the
    token ids on the learner's, the lengths on the host)."""
    host = torch.tensor(positions)
    by_device = {host.device: host}
    out = {}
    for name, value in data.items():
        if isinstance(value, torch.Tensor):
            index = by_device.setdefault(value.device, host.to(value.device))
            out[name] = value[index]
    return out


class AdvantageTerm:
    """A term the learner adds to the estimator's advantages, and what it needs of an update: no term at
    all by default (every method a no-op); `Distillation`, a teacher's, where `rl.teacher` names one.
    `advantage_term(config, device)` gives the learner its term."""

    def prepare(self, batch: RolloutBatch, still: torch.Tensor) -> torch.Tensor:
        """Before the update, its advantages computed: the groups `still` without signal ([G] bool) less
        those the term gives a signal of its own."""
        return still

    def carries(self, batch: RolloutBatch) -> bool:
        """Whether any row of `batch` has the term's signal (an update runs for it, whatever the rewards)."""
        return False

    def scores(self, forward, data: dict, part: slice, rows: list[int], batch: RolloutBatch):
        """What the term needs of a micro-batch before the policy's forward (None: nothing)."""
        return None

    def advantages(self, scores, old_logp, estimated, mask) -> tuple[torch.Tensor, dict]:
        """The micro-batch's advantages with the term added, and the sums its figures are made of."""
        return estimated, {}

    def finish(self, stats: dict[str, float], trained_tokens: float) -> None:
        """The step's figures of the term in `stats`, from the sums the micro-batches added up."""


def advantage_term(config: Config, device: torch.device) -> AdvantageTerm:
    """The learner's advantage term: the teachers of `rl.teacher` where it names any, else none."""
    return Distillation(config, device) if config.rl.teacher.enabled else AdvantageTerm()


class Distillation(AdvantageTerm):
    """The teachers of `rl.teacher` and what they add to an update: on-policy distillation's per-token
    term (algorithms/distill.py) on the rows a teacher covers."""

    def __init__(self, config: Config, device: torch.device):
        self.section = section = config.rl.teacher
        self.teachers = {key: _load(key, path, config, device) for key, path in section.named().items()}

    def keys(self, batch: RolloutBatch, rows: list[int]) -> list[str | None]:
        """Each row's teacher key ('' for the one teacher; None: a row no teacher covers)."""
        if self.section.by is None:
            return [""] * len(rows)
        if batch.teacher_keys is None:
            raise RunError(
                f"rl.teacher.by={self.section.by} picks a teacher per prompt, but this batch carries no "
                "prompt's column values (its rollout side does not set RolloutBatch.teacher_keys)"
            )
        return [key if key in self.teachers else None for key in (batch.teacher_keys[r] for r in rows)]

    def covered(self, batch: RolloutBatch, rows: list[int] | None = None) -> torch.Tensor:
        """[n] bool: whether each of `rows` (all by default) has a teacher."""
        rows = list(range(len(batch))) if rows is None else rows
        return torch.tensor([key is not None for key in self.keys(batch, rows)], dtype=torch.bool)

    def carries(self, batch: RolloutBatch) -> bool:
        return bool(self.covered(batch).any())

    def prepare(self, batch: RolloutBatch, still: torch.Tensor) -> torch.Tensor:
        """Before the update, its advantages computed: `alone` drops the estimator's (and RL-ZVP's signs);
        the groups a teacher covers carry its signal whatever their rewards, so they are no longer among
        the groups `still` without any ([G] bool, returned)."""
        if self.section.mode == "alone":
            batch.advantages = torch.zeros_like(batch.advantages)
            batch.zvp_sign = None
        taught = torch.zeros_like(still).index_put_(
            (batch.group_index,), self.covered(batch), accumulate=True
        )
        return still & ~taught

    @torch.no_grad()
    def scores(self, forward, data: dict, part: slice, rows: list[int], batch: RolloutBatch):
        """([b, T] the teachers' log-probs of the sampled tokens of `data`'s rows `part`, the batch's rows
        `rows`; [b] bool on the device: the rows that have a teacher; with several teachers, each one's rows
        by its name, else {}), each teacher on its own rows."""
        keys = self.keys(batch, rows)
        out = None
        for key, model in self.teachers.items():
            mine = [i for i, k in enumerate(keys) if k == key]
            if len(mine) == len(keys):  # one teacher scores the whole micro-batch
                out = forward.frozen_logprobs(model, data, part)
                break
            if not mine:
                continue
            logp = forward.frozen_logprobs(model, _rows_of(data, [part.start + i for i in mine]), slice(None))
            if out is None:
                out = logp.new_zeros((len(keys), logp.shape[1]))
            out[torch.tensor(mine, device=out.device)] = logp
        covered = torch.tensor([k is not None for k in keys], dtype=torch.bool)
        if out is None:  # no row of this micro-batch has a teacher
            width = data["input_ids"].shape[1] - 1
            out = torch.zeros((len(keys), width), device=data["input_ids"].device)
        each = {  # several teachers: each one's rows, for its own figures
            name: torch.tensor([k == name for k in keys], dtype=torch.bool).to(out.device)
            for name in (self.teachers if self.section.by is not None else ())
        }
        return out, covered.to(out.device), each

    def advantages(self, scores, old_logp, estimated, mask):
        """The micro-batch's advantages [b, T]: the estimator's (`estimated`, [b] or [b, T]) plus the
        distillation term from the teachers' `scores` and the old policy's log-probs (the policy that
        sampled); and the sums `finish` makes the step's figures of."""
        teacher_logp, covered, each = scores
        estimated = estimated[:, None].expand_as(old_logp) if estimated.dim() == 1 else estimated
        distilled = distillation_advantages(old_logp, teacher_logp, covered, self.section.coef)
        sums = distillation_sums(old_logp, teacher_logp, covered, mask, distilled, estimated, each)
        return estimated + distilled, sums

    def finish(self, stats: dict[str, float], trained_tokens: float) -> None:
        """The step's `distill/*` figures in `stats`, in place of the sums the micro-batches added up."""
        stats.update(distillation_metrics(stats, trained_tokens))
