"""The tiny query-shapes task: its database, questions, shapes, teacher and warm-start batches."""

from __future__ import annotations

import random
import sqlite3
from collections import Counter

import pytest

from verl_replay.data import tiny_shapes as ts
from verl_replay.rewards import compute_score
from verl_replay.sql.descriptor import structural_descriptor


@pytest.fixture(scope="module")
def database(tmp_path_factory):
    path = tmp_path_factory.mktemp("shapes") / ts.DB_ID / f"{ts.DB_ID}.sqlite"
    ts.write_database(path, ts.product_rows())
    return path


@pytest.fixture(scope="module")
def split(database):
    return ts.shapes_questions(database)


def test_the_table_has_distinct_prices_and_stocks_in_range(database):
    with sqlite3.connect(database) as conn:
        rows = conn.execute("SELECT id, price, stock FROM products").fetchall()
    assert len(rows) == ts.PRODUCTS
    for column in (1, 2):
        values = [row[column] for row in rows]
        assert len(set(values)) == ts.PRODUCTS and all(v in ts.VALUES for v in values)
    assert ts.product_rows() == ts.product_rows(seed=0) != ts.product_rows(seed=1)


def test_the_three_shapes_are_three_cells_of_the_archive():
    # written out by hand: what the archive's descriptor must call each shape of each kind
    expected = {
        "count_above": ("j0|d0|AGG", "j0|d0|AGG,CASE", "j0|d1|AGG"),
        "count_below": ("j0|d0|AGG", "j0|d0|AGG,CASE", "j0|d1|AGG"),
        "max_below": ("j0|d0|AGG", "j0|d0|OB,LIM", "j0|d1|AGG"),
        "min_above": ("j0|d0|AGG", "j0|d0|OB,LIM", "j0|d1|AGG"),
    }
    assert set(expected) == set(ts.KINDS)
    for kind, descriptors in expected.items():
        question = ts.ShapesQuestion(kind, "stock", 57)
        assert tuple(structural_descriptor(sql) for sql in question.queries) == descriptors


def test_every_kept_question_has_agreeing_informative_shapes(database, split):
    train, held_out = split
    assert len(held_out) == ts.HELD_OUT and len(train) > 3 * ts.HELD_OUT
    for question in train + held_out:
        results = [sorted(sqlite3.connect(database).execute(sql).fetchall()) for sql in question.queries]
        assert results[0] == results[1] == results[2], question
        assert results[0] and results[0][0][0] not in (None, 0), question
    assert Counter(q.kind for q in held_out).keys() == set(ts.KINDS)


def test_the_held_out_questions_are_never_training_questions(split, database):
    train, held_out = split
    assert not {q.text for q in train} & {q.text for q in held_out}
    assert ts.shapes_questions(database) == split and ts.shapes_questions(database, seed=1) != split


def test_a_question_without_an_informative_answer_is_dropped(split):
    train, held_out = split
    kept = {(q.kind, q.column, q.threshold) for q in train + held_out}
    # nothing lies below 10 or above 99: no count, no highest value below, no lowest value above
    for kind in ts.KINDS:
        for column in ts.COLUMNS:
            assert (kind, column, 10) not in kept or kind in ("count_above", "min_above")
            assert (kind, column, 99) not in kept or kind in ("count_below", "max_below")


def test_rows_reward_every_shape_and_no_miscopied_threshold(split, database):
    train, _ = split
    question = next(q for q in train if q.kind == "count_above")
    (row,) = ts.shapes_rows([question], database, "train")
    assert row["prompt"] == [{"role": "user", "content": question.text}]
    assert row["extra_info"]["gold_sqls"] == list(question.queries) and row["data_source"] == ts.TINY_SHAPES_SOURCE
    info = row["extra_info"]
    for sql in question.queries:
        assert compute_score(row["data_source"], sql, row["reward_model"]["ground_truth"], info)["acc"] == 1.0
    for shape in range(len(ts.SHAPES)):
        wrong = question.query(shape, question.threshold + 1 if question.threshold < 90 else question.threshold - 1)
        with sqlite3.connect(database) as conn:
            same = conn.execute(wrong).fetchall() == conn.execute(question.queries[0]).fetchall()
        assert compute_score(row["data_source"], wrong, row["reward_model"]["ground_truth"], info)["acc"] == float(same)


def test_a_miscopied_threshold_almost_always_changes_the_answer(split, database):
    train, _ = split
    rng = random.Random(0)
    changed = total = 0
    with sqlite3.connect(database) as conn:
        for question in rng.sample(train, 100):
            right = conn.execute(question.queries[0]).fetchall()
            for digit in range(2):
                text = str(question.threshold)
                other = text[:digit] + str((int(text[digit]) + rng.randrange(1, 10)) % 10) + text[digit + 1 :]
                total += 1
                changed += conn.execute(question.query(0, other)).fetchall() != right
    assert changed / total > 0.8  # 80 of the 90 values are taken: a different threshold moves the answer


def test_the_teacher_writes_the_shapes_at_their_rates_with_their_noise():
    question, draws = ts.ShapesQuestion("count_above", "price", 57), 30_000
    rng = random.Random(0)
    answers = [ts.teacher_answer(question, rng) for _ in range(draws)]
    shapes = Counter(shape for shape, _ in answers)
    for shape, rate in enumerate(ts.SHAPE_RATES):
        assert shapes[shape] / draws == pytest.approx(rate, abs=0.01)
        miscopied = sum(sql != question.query(shape) for s, sql in answers if s == shape) / shapes[shape]
        right_digit = 1 - ts.SHAPE_NOISE[shape] * 0.9  # a replaced digit is the right one a tenth of the time
        assert miscopied == pytest.approx(1 - right_digit**2, abs=0.03)


def test_warm_start_batches_train_on_the_query_and_eos_only(split):
    train, _ = split
    prompt_ids = {q.text: [1, 2, 3] + [len(q.text) % 7] for q in train}
    encode_answer = lambda text: [10 + (ord(c) % 50) for c in text]  # noqa: E731
    (batch,) = ts.warm_start_batches(
        train, prompt_ids.__getitem__, encode_answer, eos_id=99, pad_id=0, seed=0, steps=1, batch_size=5
    )
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    for row in range(5):
        length = int(batch["attention_mask"][row].sum())
        labels = batch["labels"][row]
        assert (labels[:4] == -100).all() and (labels[length:] == -100).all()
        assert labels[length - 1] == 99 and (labels[4:length] == batch["input_ids"][row, 4:length]).all()
