"""sql_skeleton: strategy identity for evaluation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import verl_replay
from verl_replay.sql.skeleton import SQLParseError, parse_query, sql_skeleton

JOIN = "SELECT T1.name FROM singer AS T1 JOIN concert AS T2 ON T1.singer_id = T2.singer_id WHERE T2.year = 2014"
IN_SUBQUERY = "SELECT name FROM singer WHERE singer_id IN (SELECT singer_id FROM concert WHERE year = 2014)"
EXISTS = (
    "SELECT name FROM singer AS s WHERE EXISTS "
    "(SELECT 1 FROM concert AS c WHERE c.singer_id = s.singer_id AND c.year = 2014)"
)
CTE = (
    "WITH c2014 AS (SELECT singer_id FROM concert WHERE year = 2014) "
    "SELECT name FROM singer JOIN c2014 ON singer.singer_id = c2014.singer_id"
)


def test_public_export_is_this_function() -> None:
    assert verl_replay.sql_skeleton is sql_skeleton


def test_rendering_of_a_join_query() -> None:
    # Hand-derived: names -> tbl/col, literal -> ?, '=' operands sorted ('?' < 'c').
    assert sql_skeleton(JOIN) == "SELECT col FROM tbl JOIN tbl ON col = col WHERE ? = col"


def test_alias_renaming_gives_same_skeleton() -> None:
    renamed = "SELECT s.name FROM singer s JOIN concert c ON s.singer_id = c.singer_id WHERE c.year = 2014"
    unaliased = (
        "SELECT singer.name FROM singer JOIN concert ON singer.singer_id = concert.singer_id WHERE concert.year = 2014"
    )
    assert sql_skeleton(JOIN) == sql_skeleton(renamed) == sql_skeleton(unaliased)


def test_projection_and_subquery_aliases_are_ignored() -> None:
    a = "SELECT COUNT(*) AS n FROM (SELECT a FROM t) AS sub"
    b = "SELECT COUNT(*) FROM (SELECT a AS x FROM t)"
    assert sql_skeleton(a) == sql_skeleton(b)


def test_literal_changes_give_same_skeleton() -> None:
    a = "SELECT name FROM t WHERE year = 2014 AND city = 'Paris' AND score > -3.5 LIMIT 1"
    b = "SELECT name FROM t WHERE year = 1999 AND city = 'Rome' AND score > 7 LIMIT 10"
    assert sql_skeleton(a) == sql_skeleton(b)


def test_in_lists_of_constants_collapse() -> None:
    assert sql_skeleton("SELECT a FROM t WHERE b IN (1, 2, 3)") == sql_skeleton("SELECT a FROM t WHERE b IN ('x')")
    # ... but a list holding a column is structure, not data.
    assert sql_skeleton("SELECT a FROM t WHERE b IN (1, c)") != sql_skeleton("SELECT a FROM t WHERE b IN (1)")


def test_operand_order_of_eq_and_or_is_irrelevant() -> None:
    a = "SELECT a FROM t JOIN u ON t.id = u.tid WHERE t.x = 1 AND (u.y = 2 OR u.z = 3) AND t.w != 4"
    b = "SELECT a FROM t JOIN u ON u.tid = t.id WHERE (u.z = 3 OR 2 = u.y) AND 4 <> t.w AND 1 = t.x"
    assert sql_skeleton(a) == sql_skeleton(b)


def test_nested_and_chains_are_flattened() -> None:
    a = "SELECT a FROM t WHERE (x = 1 AND (y = 2 AND z = 3)) AND w > 4"
    b = "SELECT a FROM t WHERE w > 4 AND z = 3 AND y = 2 AND x = 1"
    assert sql_skeleton(a) == sql_skeleton(b)


def test_precedence_is_kept() -> None:
    or_of_and = "SELECT a FROM t WHERE (x = 1 AND y = 2) OR z = 3"
    and_of_or = "SELECT a FROM t WHERE x = 1 AND (y = 2 OR z = 3)"
    assert sql_skeleton(or_of_and) == sql_skeleton("SELECT a FROM t WHERE z = 3 OR y = 2 AND x = 1")
    assert sql_skeleton(or_of_and) != sql_skeleton(and_of_or)


def test_non_commutative_operators_keep_order() -> None:
    assert sql_skeleton("SELECT a FROM t WHERE b > 1") != sql_skeleton("SELECT a FROM t WHERE 1 > b")
    assert sql_skeleton("SELECT a - 1 FROM t") != sql_skeleton("SELECT 1 - a FROM t")


def test_different_formulations_give_different_skeletons() -> None:
    skeletons = {sql_skeleton(q) for q in (JOIN, IN_SUBQUERY, EXISTS, CTE)}
    assert len(skeletons) == 4


def test_case_whitespace_and_quoting_are_irrelevant() -> None:
    plain = "SELECT name, COUNT(*) FROM singer WHERE age > 20 GROUP BY name ORDER BY name"
    noisy = 'select   "Name" ,count( * )\nFROM [Singer]\n\twhere `AGE`>20 group by name order BY name ASC;'
    assert sql_skeleton(plain) == sql_skeleton(noisy)


def test_join_spellings_and_redundant_parentheses() -> None:
    assert sql_skeleton("SELECT a FROM t INNER JOIN u ON t.x = u.x") == sql_skeleton(
        "SELECT a FROM t JOIN u ON (t.x = u.x)"
    )
    assert sql_skeleton("SELECT a FROM t LEFT OUTER JOIN u ON t.x = u.x") == sql_skeleton(
        "SELECT a FROM t LEFT JOIN u ON t.x = u.x"
    )
    assert sql_skeleton("SELECT a FROM t LEFT JOIN u ON t.x = u.x") != sql_skeleton(
        "SELECT a FROM t JOIN u ON t.x = u.x"
    )
    assert sql_skeleton("SELECT ((a)) FROM t WHERE ((b = 1))") == sql_skeleton("SELECT a FROM t WHERE b = 1")


def test_order_direction_and_distinct_matter() -> None:
    base = "SELECT a FROM t ORDER BY a"
    assert sql_skeleton(base) != sql_skeleton(base + " DESC")
    assert sql_skeleton("SELECT DISTINCT a FROM t") != sql_skeleton("SELECT a FROM t")


def test_parse_errors_are_clear() -> None:
    for bad in ("SELEC name FROM", "SELECT * FROM (", "", "   ;", "SELECT 1; SELECT 2", "DROP TABLE t", "hello world"):
        with pytest.raises(SQLParseError):
            sql_skeleton(bad)
    with pytest.raises(ValueError, match="exactly one"):
        parse_query("SELECT 1; SELECT 2")
    with pytest.raises(SQLParseError, match="not a query"):
        parse_query("INSERT INTO t VALUES (1)")


def test_input_is_not_mutated_between_calls() -> None:
    first = sql_skeleton(EXISTS)
    assert sql_skeleton(EXISTS) == first


_COLUMNS = st.sampled_from(["a", "b", "c", "d"])
_LITERALS = st.one_of(st.integers(-1000, 1000).map(str), st.text("xyz", min_size=1, max_size=4).map(lambda s: f"'{s}'"))


@settings(max_examples=40, deadline=None)
@given(
    columns=st.lists(_COLUMNS, min_size=1, max_size=5),
    literals=st.data(),
    perm=st.randoms(use_true_random=False),
    flips=st.lists(st.booleans(), min_size=5, max_size=5),
    alias=st.from_regex(r"[a-z][a-z0-9]{0,5}", fullmatch=True),
)
def test_property_conjunction_order_literals_and_alias(columns, literals, perm, flips, alias) -> None:
    if alias in {"as", "on", "in", "is", "or", "by", "if", "do", "to", "of"}:
        alias = "zz"
    values_a = [literals.draw(_LITERALS) for _ in columns]
    values_b = [literals.draw(_LITERALS) for _ in columns]
    preds_a = [f"t.{c} = {v}" for c, v in zip(columns, values_a, strict=True)]
    preds_b = [
        f"{v} = {alias}.{c}" if flip else f"{alias}.{c} = {v}"
        for c, v, flip in zip(columns, values_b, flips[: len(columns)], strict=True)
    ]
    perm.shuffle(preds_b)
    a = f"SELECT t.a FROM tab AS t WHERE {' AND '.join(preds_a)}"
    b = f"SELECT {alias}.a FROM tab {alias} WHERE {' AND '.join(preds_b)}"
    assert sql_skeleton(a) == sql_skeleton(b)
