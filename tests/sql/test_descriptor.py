"""Structural descriptor of SQL queries."""

from __future__ import annotations

import pytest

from verl_replay.sql.descriptor import StructuralDescriptor, describe_sql, structural_descriptor
from verl_replay.sql.skeleton import SQLParseError, parse_query


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SELECT a FROM t", "j0|d0|-"),
        ("SELECT COUNT(*) FROM t WHERE x = 1", "j0|d0|AGG"),
        (
            "SELECT T1.name, COUNT(*) FROM singer AS T1 JOIN concert AS T2 ON T1.id = T2.sid "
            "GROUP BY T1.name HAVING COUNT(*) > 1 ORDER BY COUNT(*) DESC LIMIT 1",
            "j1|d0|AGG,GB,HAV,OB,LIM",
        ),
        ("SELECT a FROM t, u, v, w JOIN x ON 1 = 1", "j3+|d0|-"),
        ("SELECT a FROM t JOIN u ON t.x = u.x JOIN v ON v.y = u.y", "j2|d0|-"),
        ("SELECT a FROM t WHERE b IN (SELECT b FROM u)", "j0|d1|-"),
        ("SELECT a FROM t WHERE b IN (SELECT b FROM u WHERE c = (SELECT MAX(c) FROM v))", "j0|d2+|AGG"),
        ("SELECT a FROM t WHERE EXISTS (SELECT 1 FROM u WHERE u.k = t.k)", "j0|d1|EX"),
        ("WITH x AS (SELECT a FROM t) SELECT a FROM x", "j0|d0|CTE"),
        ("SELECT a FROM t UNION SELECT a FROM u", "j0|d0|SET"),
        ("SELECT DISTINCT a, RANK() OVER (ORDER BY b DESC) FROM t", "j0|d0|WIN,DIST"),
        ("SELECT SUM(CASE WHEN a = 1 THEN 1 ELSE 0 END), COUNT(DISTINCT b) FROM t", "j0|d0|AGG,DIST,CASE"),
        ("SELECT IIF(a > 1, 'y', 'n') FROM t", "j0|d0|CASE"),
        ("SELECT TOTAL(a) FROM t", "j0|d0|AGG"),
    ],
)
def test_descriptor_strings(sql: str, expected: str) -> None:
    assert structural_descriptor(sql) == expected


def test_cte_bodies_are_not_nesting_but_subqueries_inside_them_are() -> None:
    assert describe_sql("WITH x AS (SELECT a FROM t) SELECT a FROM x").depth == 0
    inner = "WITH x AS (SELECT a FROM t WHERE a IN (SELECT a FROM u)) SELECT a FROM x"
    assert describe_sql(inner).depth == 1
    nested_owner = "SELECT a FROM t WHERE a IN (WITH x AS (SELECT a FROM u) SELECT a FROM x)"
    assert describe_sql(nested_owner).depth == 1


def test_structured_form_and_buckets() -> None:
    d = describe_sql("SELECT a FROM t JOIN u ON t.x = u.x WHERE a IN (SELECT a FROM v) ORDER BY a")
    assert isinstance(d, StructuralDescriptor)
    assert (d.num_joins, d.depth, d.has_join, d.has_subquery) == (1, 1, True, True)
    assert d.flags == ("OB",)
    assert str(d) == d.key == "j1|d1|OB"


def test_accepts_a_parsed_tree_and_is_deterministic() -> None:
    sql = "SELECT a, COUNT(*) FROM t GROUP BY a ORDER BY 2 LIMIT 3"
    assert structural_descriptor(parse_query(sql)) == structural_descriptor(sql) == "j0|d0|AGG,GB,OB,LIM"


def test_surface_differences_do_not_change_descriptor() -> None:
    a = "SELECT T1.a FROM t AS T1 JOIN u AS T2 ON T1.id = T2.id WHERE T2.y = 3"
    b = "select x.a from T x inner join U y on y.id = x.id where y.y = 'q'"
    assert structural_descriptor(a) == structural_descriptor(b)


def test_unparseable_sql_raises() -> None:
    with pytest.raises(SQLParseError):
        structural_descriptor("SELECT FROM WHERE")
