"""Tiny text-to-SQL with several right query shapes: the CPU task on which archive replay can differ.

One SQLite table, ``products(id, price, stock)``: ``PRODUCTS`` products whose prices, and whose
stocks, are distinct values in 10-99. A question asks, about one column and a two-digit
threshold, for a count above or below it, the highest value below it or the lowest above it
("What is the highest stock below 57?"). Every question has three right queries of different
shapes, which the archive's structural descriptor tells apart:

==========  ==============================================  =================
shape       example (highest stock below 57)                descriptor
==========  ==============================================  =================
aggregate   ``SELECT MAX(stock) FROM products WHERE ...``    ``j0|d0|AGG``
rewrite     ``... ORDER BY stock DESC LIMIT 1`` (counts:     ``j0|d0|OB,LIM``
            ``SUM(CASE WHEN ... THEN 1 ELSE 0 END)``)        (``AGG,CASE``)
subquery    ``SELECT MAX(stock) FROM (SELECT stock ...)``    ``j0|d1|AGG``
==========  ==============================================  =================

Every shape of a question is executed when the task is built; a question is kept only if they
agree and the answer is informative (not empty, not a lone NULL or 0).

Why archive replay can change something here: the warm start is supervised on a teacher that
writes the shapes at ``SHAPE_RATES`` and copies the threshold less reliably in the rarer shapes
(each threshold digit replaced by a random digit with probability ``SHAPE_NOISE``). The base
model therefore samples every shape, and is right in each, but less often in the rare ones. GRPO,
rewarded for right answers only, can raise pass@1 by moving to the reliable shape and dropping
the others; an archive of the frozen base's right answers holds the rare shapes too. With
``PRODUCTS`` of the 90 possible values taken, a miscopied threshold almost always changes the
answer, so the reward tells a right copy from a wrong one.

``HELD_OUT`` questions form the validation (and evaluation) set, never trained on: not by the warm
start, not in the RL rows. Stdlib, sqlite3 and torch only; the model and its cache live in
:mod:`verl_replay.data.tiny_tasks`.
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_replay.data.schema import connect_readonly
from verl_replay.data.tiny_arith import answer_batch

TINY_SHAPES_SOURCE = "tiny_sql_shapes"
DB_ID = "stock"
COLUMNS = ("price", "stock")
VALUES = range(10, 100)
PRODUCTS = 80
HELD_OUT = 128
SHAPES = ("aggregate", "rewrite", "subquery")
SHAPE_RATES = (0.6, 0.25, 0.15)
SHAPE_NOISE = (0.15, 0.45, 0.45)
DDL = "CREATE TABLE products (id INTEGER PRIMARY KEY, price INTEGER NOT NULL, stock INTEGER NOT NULL)"

# kind -> (question wording, comparison, the shapes' queries); {c}: column, {n}: threshold
_KINDS: dict[str, tuple[str, str, tuple[str, str, str]]] = {
    "count_above": (
        "How many products have {c} above {n}?",
        ">",
        (
            "SELECT COUNT(*) FROM products WHERE {c} > {n}",
            "SELECT SUM(CASE WHEN {c} > {n} THEN 1 ELSE 0 END) FROM products",
            "SELECT COUNT(*) FROM (SELECT id FROM products WHERE {c} > {n})",
        ),
    ),
    "count_below": (
        "How many products have {c} below {n}?",
        "<",
        (
            "SELECT COUNT(*) FROM products WHERE {c} < {n}",
            "SELECT SUM(CASE WHEN {c} < {n} THEN 1 ELSE 0 END) FROM products",
            "SELECT COUNT(*) FROM (SELECT id FROM products WHERE {c} < {n})",
        ),
    ),
    "max_below": (
        "What is the highest {c} below {n}?",
        "<",
        (
            "SELECT MAX({c}) FROM products WHERE {c} < {n}",
            "SELECT {c} FROM products WHERE {c} < {n} ORDER BY {c} DESC LIMIT 1",
            "SELECT MAX({c}) FROM (SELECT {c} FROM products WHERE {c} < {n})",
        ),
    ),
    "min_above": (
        "What is the lowest {c} above {n}?",
        ">",
        (
            "SELECT MIN({c}) FROM products WHERE {c} > {n}",
            "SELECT {c} FROM products WHERE {c} > {n} ORDER BY {c} LIMIT 1",
            "SELECT MIN({c}) FROM (SELECT {c} FROM products WHERE {c} > {n})",
        ),
    ),
}
KINDS = tuple(_KINDS)


@dataclass(frozen=True)
class ShapesQuestion:
    """One question: its kind, column and threshold; ``queries`` has one right query per shape."""

    kind: str
    column: str
    threshold: int

    @property
    def text(self) -> str:
        return _KINDS[self.kind][0].format(c=self.column, n=self.threshold)

    def query(self, shape: int, threshold: int | str | None = None) -> str:
        """The ``shape``-th query, with ``threshold`` written in place of the question's own."""
        written = self.threshold if threshold is None else threshold
        return _KINDS[self.kind][2][shape].format(c=self.column, n=written)

    @property
    def queries(self) -> tuple[str, ...]:
        return tuple(self.query(shape) for shape in range(len(SHAPES)))


def product_rows(seed: int = 0) -> list[tuple[int, int, int]]:
    """``(id, price, stock)`` rows: distinct prices and distinct stocks, deterministic from ``seed``."""
    rng = random.Random(f"tiny-shapes-db-{seed}")
    prices = rng.sample(list(VALUES), PRODUCTS)
    stocks = rng.sample(list(VALUES), PRODUCTS)
    return [(index + 1, price, stock) for index, (price, stock) in enumerate(zip(prices, stocks, strict=True))]


def write_database(path: Path, rows: Sequence[tuple[int, int, int]]) -> None:
    """The task's SQLite file at ``path`` (replaced if present)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    conn = sqlite3.connect(path)
    try:
        conn.execute(DDL)
        conn.executemany("INSERT INTO products VALUES (?, ?, ?)", rows)
        conn.commit()
    finally:
        conn.close()


def _informative(rows: list[tuple[Any, ...]]) -> bool:
    return bool(rows) and not all(value in (None, 0) for row in rows for value in row)


def _shapes_agree(conn: sqlite3.Connection, question: ShapesQuestion) -> bool:
    results = [set(conn.execute(sql).fetchall()) for sql in question.queries]
    return _informative(list(results[0])) and all(result == results[0] for result in results[1:])


def shapes_questions(db_path: Path, seed: int = 0) -> tuple[list[ShapesQuestion], list[ShapesQuestion]]:
    """(training questions, held-out questions) over the database at ``db_path``: every kind,
    column and threshold whose three shapes agree on an informative answer, shuffled by ``seed``."""
    candidates = [ShapesQuestion(kind, column, n) for kind in KINDS for column in COLUMNS for n in VALUES]
    # our own queries over an 80-row table: one read-only connection for all of them
    conn = connect_readonly(db_path)
    try:
        kept = [question for question in candidates if _shapes_agree(conn, question)]
    finally:
        conn.close()
    if len(kept) <= 2 * HELD_OUT:
        raise RuntimeError(f"tiny shapes: only {len(kept)} questions have agreeing shapes on {db_path}")
    random.Random(f"tiny-shapes-split-{seed}").shuffle(kept)
    return kept[HELD_OUT:], kept[:HELD_OUT]


def shapes_rows(questions: Sequence[ShapesQuestion], db_path: Path, split: str) -> list[dict[str, Any]]:
    """verl RL rows: the question as the user turn (the one table is implied), every shape as a
    gold query, the database as the SQL reward reads it."""
    return [
        {
            "data_source": TINY_SHAPES_SOURCE,
            "prompt": [{"role": "user", "content": question.text}],
            "ability": "sql",
            "reward_model": {"style": "rule", "ground_truth": question.queries[0]},
            "extra_info": {
                "split": split,
                "index": index,
                "question_id": f"{TINY_SHAPES_SOURCE}-{split}-{index:04d}",
                "db_id": DB_ID,
                "db_path": str(Path(db_path).absolute()),
                "semantics": "bird",
                "question": question.text,
                "evidence": "",
                "gold_sqls": list(question.queries),
            },
        }
        for index, question in enumerate(questions)
    ]


def teacher_answer(question: ShapesQuestion, rng: random.Random) -> tuple[int, str]:
    """``(shape, query)`` as the teacher writes it: a shape drawn at ``SHAPE_RATES``, each digit of
    the threshold replaced by a random digit with that shape's ``SHAPE_NOISE``."""
    shape = rng.choices(range(len(SHAPES)), weights=SHAPE_RATES)[0]
    noise = SHAPE_NOISE[shape]
    digits = "".join(str(rng.randrange(10)) if rng.random() < noise else d for d in str(question.threshold))
    return shape, question.query(shape, digits)


def warm_start_batches(
    questions: Sequence[ShapesQuestion],
    encode_prompt: Callable[[str], list[int]],
    encode_answer: Callable[[str], list[int]],
    *,
    eos_id: int,
    pad_id: int,
    seed: int,
    steps: int,
    batch_size: int,
) -> Iterator[dict[str, Any]]:
    """``steps`` supervised batches of prompt + teacher query + eos over ``questions`` (the training
    questions only), the loss on the query and eos."""
    rng = random.Random(f"tiny-shapes-teacher-{seed}")
    prompts = {question: encode_prompt(question.text) for question in questions}
    for _ in range(steps):
        rows = []
        for _ in range(batch_size):
            question = rng.choice(questions)
            answer = encode_answer(teacher_answer(question, rng)[1]) + [eos_id]
            rows.append((prompts[question], answer))
        yield answer_batch(rows, pad_id)
