"""Scalar reward model: a sequence-classification checkpoint (one output) scores each response.

Group normalisation turns such a model's noise on equal-quality responses into advantages of magnitude
~1 and random sign (bench/quality/inversion.py); pair it with `rl.dead_zone` or prefer a ternary judge
(`rewards.function=genrm`).
"""

from __future__ import annotations


class ScalarRM:
    """`fn(completions, prompt=...) -> list[float]`: the checkpoint's score of template(question, response).
    Loads on first call (in the reward worker)."""

    def __init__(self, model: str, template: str = "{question}\n{response}", batch_size: int = 32):
        for field in ("{question}", "{response}"):
            if field not in template:
                raise ValueError(f"rewards.scalar_rm.template has no {field} field")
        self.model_path, self.template, self.batch_size = model, template, batch_size
        self._model = self._tokenizer = None

    @classmethod
    def from_config(cls, config) -> ScalarRM:
        return cls(config.model, config.template, config.batch_size)

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification

        from everyprompt.models.io import ModelError, load_pretrained

        model, self._tokenizer = load_pretrained(self.model_path, AutoModelForSequenceClassification)
        if model.config.num_labels != 1:
            raise ModelError(
                f"{self.model_path}: a scalar reward model has one output, this one has {model.config.num_labels}"
            )
        model.config.pad_token_id = self._tokenizer.pad_token_id  # the score is read at the last real token
        self._model = model.eval()

    def __call__(self, completions: list[str], prompt: list | None = None, **_) -> list[float]:
        import torch

        if prompt is None:
            raise ValueError("the scalar_rm reward needs the rows' `prompt` field")
        if self._model is None:
            self._load()
        texts = [self.template.format(question=q, response=c) for q, c in zip(prompt, completions)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self._tokenizer(texts[start : start + self.batch_size], return_tensors="pt", padding=True)
            with torch.no_grad():
                scores.extend(self._model(**batch).logits[:, 0].float().tolist())
        return scores
