"""Exact expected accuracy on the validation set, through the run's own actor.

At every validation, for each held-out question whose right answers can be enumerated (data
sources scored by exact match, see :func:`verl_replay.rewards.is_exact_answer_source`), the actor
scores every ``answer + stop token`` sequence teacher-forced at the validation temperature, with
the same worker call and row layout as the Headroom-Drift scan (:class:`PolicyScorer`). The
probability that a sampled response is right is the sum of those sequences' probabilities
(:mod:`verl_replay.eval.exact_answer`): ``val-exact/<source>/acc/expected`` in the run's metrics,
next to verl's sampled ``val-core/<source>/acc/mean@n``, which estimates the same number with
sampling noise. What the two measure differs only in what the enumeration misses (answers with
surrounding whitespace, or followed by a special token that decoding drops): the sampled number
can exceed the exact one by that much, never fall below it except by noise.

The actor is the policy after the step's update; in ``separate_async`` the rollout that sampled the
same validation may still hold the weights of the previous push.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from verl_replay.eval.exact_answer import AnswerSequences, accuracy_summary, answer_sequences, expected_accuracy
from verl_replay.headroom_drift.buffer import ReplayGroup
from verl_replay.integrations.verl.rows import POSITION_ROWS_META, plain
from verl_replay.rewards import is_exact_answer_source

__all__ = [
    "METRIC_PREFIX",
    "ExactAnswerEval",
    "exact_questions",
    "stop_token_ids",
]

METRIC_PREFIX = "val-exact"
# groups per worker call: bounds the scratch rows held in TransferQueue at once
_CALL_GROUPS = 512


def stop_token_ids(model_path: str, tokenizer: Any) -> list[int]:
    """The tokens that end generation: the model's generation config eos ids (vLLM stops on them),
    else the tokenizer's eos."""
    ids: list[int] = []
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids = [int(eos)] if isinstance(eos, int) else [int(t) for t in (eos or [])]
    except (OSError, ValueError):
        ids = []
    if tokenizer.eos_token_id is not None and int(tokenizer.eos_token_id) not in ids:
        ids.append(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError(f"{model_path}: neither its generation config nor its tokenizer names an eos token")
    return ids


def _read_rows(files: Sequence[str]) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for path in files:
        rows.extend(pq.read_table(Path(path)).to_pylist())
    return rows


def exact_questions(
    val_files: Sequence[str],
    tokenizer: Any,
    *,
    stop_ids: Sequence[int],
    chat_template_kwargs: Optional[Mapping[str, Any]] = None,
    prompt_key: str = "prompt",
    max_prompt_length: Optional[int] = None,
) -> list[AnswerSequences]:
    """The validation rows of exact-answer sources, tokenized as the rollout sees them (chat
    template with the generation prompt); rows whose prompt exceeds ``max_prompt_length`` are
    left out, as verl's dataset filter leaves them out of validation."""
    kwargs = dict(chat_template_kwargs or {})
    questions: list[AnswerSequences] = []
    for row in _read_rows(val_files):
        source = str(row.get("data_source", ""))
        if not is_exact_answer_source(source):
            continue
        messages = plain(row[prompt_key])
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
        if max_prompt_length is not None and len(prompt) > max_prompt_length:
            continue
        golds = plain((row.get("reward_model") or {}).get("ground_truth"))
        golds = golds if isinstance(golds, list) else [golds]
        answers = [tokenizer.encode(str(gold).strip(), add_special_tokens=False) for gold in golds]
        questions.append(answer_sequences(len(questions), source, prompt, answers, stop_ids))
    return questions


def _question_group(question: AnswerSequences, position_rows: tuple[int, ...]) -> ReplayGroup:
    responses = [torch.tensor(r, dtype=torch.int32) for r in question.responses]
    total = sum(r.numel() for r in responses)
    n = len(responses)
    return ReplayGroup(
        prompt_ids=torch.tensor(question.prompt_ids, dtype=torch.int32),  # [P]
        response_ids=torch.cat(responses),  # [L]
        response_lengths=torch.tensor([r.numel() for r in responses], dtype=torch.int64),  # [n]
        response_mask=torch.ones(total, dtype=torch.bool),  # [L]
        gen_log_probs=torch.zeros(total, dtype=torch.float32),  # [L], unused: no anchor
        advantages=torch.zeros(n, dtype=torch.float32),  # [n]
        correct=torch.ones(n, dtype=torch.bool),  # [n]
        scores=torch.ones(n, dtype=torch.float32),  # [n]
        meta={"shared": {POSITION_ROWS_META: list(position_rows)}} if position_rows else None,
    )


class ExactAnswerEval:
    """The held-out questions as scan groups, built once; :meth:`metrics` runs them through a
    scorer (a :class:`PolicyScorer` at the validation temperature)."""

    def __init__(self, questions: Sequence[AnswerSequences], position_rows: tuple[int, ...] = ()) -> None:
        if not questions:
            raise ValueError("no question with enumerable right answers in the validation set")
        self.questions = list(questions)
        self.groups = [_question_group(q, position_rows) for q in self.questions]
        self.sequences = sum(len(q.responses) for q in self.questions)

    def per_question(self, scorer: Any) -> torch.Tensor:
        """``[Q]`` float64: each question's probability of a right sampled response."""
        log_probs: list[torch.Tensor] = []
        owners: list[int] = []
        for start in range(0, len(self.groups), _CALL_GROUPS):
            chunk = self.groups[start : start + _CALL_GROUPS]
            for offset, (group, flat) in enumerate(zip(chunk, scorer(chunk), strict=True)):
                lengths = group.response_lengths.tolist()
                if flat.numel() != sum(lengths):
                    raise RuntimeError(f"scorer returned {flat.numel()} log-probs for {sum(lengths)} answer tokens")
                log_probs.extend(flat.split(lengths))
                owners.extend([start + offset] * len(lengths))
        return expected_accuracy(log_probs, owners, len(self.questions))

    def metrics(self, scorer: Any) -> dict[str, float]:
        per_question = self.per_question(scorer)
        by_source = accuracy_summary(per_question, [q.data_source for q in self.questions])
        return {f"{METRIC_PREFIX}/{source}/acc/expected": value for source, value in by_source.items()}
