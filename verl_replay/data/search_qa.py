"""Search-R1-style QA data for the agentic-search domain (local files; nothing is downloaded).

Input: FlashRAG's layout, as Search-R1 uses it: one folder per dataset holding ``<split>.jsonl``
(``{"id", "question", "golden_answers": [...]}`` per line), e.g. ``nq/train.jsonl``,
``hotpotqa/train.jsonl``, ``bamboogle/test.jsonl``; a ``.parquet`` file with the same columns is
read too. Output rows: Search-R1's (``data_source`` = the dataset, ``reward_model.ground_truth =
{"target": golden answers}``) plus ``agent_name = tool_agent``, so verl's tool agent loop runs them
with the ``search`` tool; the reward is exact match of the last ``<answer>...</answer>``
(``verl_replay.rewards.search_exact_match``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Search-R1's training sets and its seven evaluation sets (test split, dev where there is no test)
TRAIN_DATASETS = ("nq", "hotpotqa")
EVAL_DATASETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
SEARCH_INSTRUCTION = (
    "Answer the given question. You may call the search tool as many times as you want to find "
    "facts you lack. When you are sure, give the final answer inside <answer> and </answer>, without "
    "detailed explanation, e.g. <answer> Beijing </answer>. Question: "
)


@dataclass(frozen=True)
class QAExample:
    dataset: str
    qid: str
    question: str
    answers: tuple[str, ...]


def _records(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(path).to_dict("records")
    out = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from exc
    return out


def load_qa_file(path: str | Path, dataset: str) -> list[QAExample]:
    """QA examples of one FlashRAG-format file (``question`` + ``golden_answers``)."""
    path = Path(path)
    examples = []
    for index, record in enumerate(_records(path)):
        question, answers = record.get("question"), record.get("golden_answers", record.get("answers"))
        if not isinstance(question, str) or answers is None:
            raise ValueError(f"{path}: row {index} needs 'question' (text) and 'golden_answers' (a list)")
        answers = [answers] if isinstance(answers, str) else [str(a) for a in list(answers)]
        if not answers:
            raise ValueError(f"{path}: row {index} has no golden answer")
        examples.append(QAExample(dataset, str(record.get("id", index)), question.strip(), tuple(answers)))
    if not examples:
        raise ValueError(f"{path}: no QA examples")
    return examples


def find_split(root: Path, dataset: str, splits: Sequence[str]) -> Path | None:
    for split in splits:
        for suffix in (".jsonl", ".parquet"):
            candidate = root / dataset / f"{split}{suffix}"
            if candidate.is_file():
                return candidate
    return None


def search_rows(examples: Sequence[QAExample], split: str) -> list[dict[str, Any]]:
    question = SEARCH_INSTRUCTION
    return [
        {
            "data_source": ex.dataset,
            "agent_name": "tool_agent",
            "prompt": [
                {"role": "user", "content": question + ex.question + ("" if ex.question.endswith("?") else "?")}
            ],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": list(ex.answers)}},
            "extra_info": {"split": split, "index": index, "question_id": ex.qid, "question": ex.question},
        }
        for index, ex in enumerate(examples)
    ]


def search_tool_config(*, retrieval_url: str | None = None, corpus: str | None = None, topk: int = 3) -> str:
    """verl's tool config (JSON, which is YAML) for LocalSearchTool: a server URL or a local corpus."""
    from verl_replay.search.index import SEARCH_TOOL_CLASS, SEARCH_TOOL_SCHEMA

    if bool(retrieval_url) == bool(corpus):
        raise ValueError("give exactly one of --retrieval-url (a verl_replay.search.server) and --corpus (JSON lines)")
    config: dict[str, Any] = {"type": "native", "topk": int(topk)}
    config.update({"retrieval_service_url": retrieval_url} if retrieval_url else {"corpus_path": str(corpus)})
    return (
        json.dumps(
            {"tools": [{"class_name": SEARCH_TOOL_CLASS, "config": config, "tool_schema": SEARCH_TOOL_SCHEMA}]},
            indent=2,
        )
        + "\n"
    )
