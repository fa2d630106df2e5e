"""Coarse structural descriptor of a SQL query: the second half of an archive cell key.

The descriptor is deliberately coarse (a MAP-Elites cell should hold a *family* of solutions):

* ``j<bucket>``: total number of joins anywhere in the query (comma joins count), bucketed
  ``0, 1, 2, 3+``;
* ``d<bucket>``: subquery nesting depth, bucketed ``0, 1, 2+``. A SELECT's depth is the number of
  SELECTs enclosing it; a CTE body sits at the depth of the query that owns the ``WITH`` (a
  CTE un-nests a query, which is exactly what the CTE flag records) and set-operation branches
  sit at the depth of the set operation;
* flags, in this fixed order: ``CTE`` (WITH), ``SET`` (UNION/INTERSECT/EXCEPT), ``WIN`` (window
  function), ``AGG`` (row-collapsing aggregate; ``SUM(x) OVER (...)`` is WIN, not AGG), ``GB``
  (GROUP BY), ``HAV`` (HAVING), ``DIST`` (DISTINCT, in SELECT or inside an aggregate), ``CASE``
  (CASE or IIF), ``EX`` (EXISTS), ``OB`` (ORDER BY), ``LIM`` (LIMIT); ``-`` when none is set.

The string form is ``"j1|d0|AGG,GB,OB,LIM"``. "has a join" and "has a subquery" are not
repeated as flags because ``j0`` / ``d0`` already say it; the dataclass exposes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlglot import exp

from verl_replay.sql.skeleton import parse_query

__all__ = ["StructuralDescriptor", "describe_sql", "structural_descriptor", "SQLITE_AGGREGATES"]

# sqlglot maps most SQLite aggregates onto AggFunc subclasses but leaves some as anonymous
# functions (TOTAL); single-argument MIN/MAX are aggregates, multi-argument ones are scalar
# (sqlglot turns those into GREATEST/LEAST, which are not AggFuncs).
SQLITE_AGGREGATES = frozenset({"avg", "count", "group_concat", "max", "min", "sum", "total"})

FLAG_ORDER = ("CTE", "SET", "WIN", "AGG", "GB", "HAV", "DIST", "CASE", "EX", "OB", "LIM")


@dataclass(frozen=True)
class StructuralDescriptor:
    """Structured form of :func:`structural_descriptor`; ``key`` is the string form."""

    num_joins: int
    depth: int
    has_cte: bool
    has_set_op: bool
    has_window: bool
    has_aggregate: bool
    has_group_by: bool
    has_having: bool
    has_distinct: bool
    has_case: bool
    has_exists: bool
    has_order_by: bool
    has_limit: bool

    @property
    def has_join(self) -> bool:
        return self.num_joins > 0

    @property
    def has_subquery(self) -> bool:
        return self.depth > 0

    @property
    def join_bucket(self) -> str:
        return str(self.num_joins) if self.num_joins < 3 else "3+"

    @property
    def depth_bucket(self) -> str:
        return str(self.depth) if self.depth < 2 else "2+"

    @property
    def flags(self) -> tuple[str, ...]:
        present = {
            "CTE": self.has_cte,
            "SET": self.has_set_op,
            "WIN": self.has_window,
            "AGG": self.has_aggregate,
            "GB": self.has_group_by,
            "HAV": self.has_having,
            "DIST": self.has_distinct,
            "CASE": self.has_case,
            "EX": self.has_exists,
            "OB": self.has_order_by,
            "LIM": self.has_limit,
        }
        return tuple(flag for flag in FLAG_ORDER if present[flag])

    @property
    def key(self) -> str:
        return f"j{self.join_bucket}|d{self.depth_bucket}|{','.join(self.flags) or '-'}"

    def __str__(self) -> str:
        return self.key


def describe_sql(sql: str | exp.Expression) -> StructuralDescriptor:
    """Structured descriptor of ``sql`` (text or an already parsed sqlglot tree).

    Raises :class:`verl_replay.sql.skeleton.SQLParseError` for text that is not one query.
    """
    tree = parse_query(sql) if isinstance(sql, str) else sql
    nodes = list(tree.walk())
    queries = [n for n in nodes if isinstance(n, exp.Query)]
    return StructuralDescriptor(
        num_joins=sum(isinstance(n, exp.Join) for n in nodes),
        depth=max((select_depth(n) for n in nodes if isinstance(n, exp.Select)), default=0),
        has_cte=any(isinstance(n, exp.CTE) for n in nodes),
        has_set_op=any(isinstance(n, exp.SetOperation) for n in nodes),
        has_window=any(isinstance(n, exp.Window) for n in nodes),
        has_aggregate=any(is_aggregate(n) for n in nodes),
        has_group_by=any(q.args.get("group") for q in queries),
        has_having=any(q.args.get("having") for q in queries),
        has_distinct=any(isinstance(n, exp.Distinct) for n in nodes),
        has_case=any(isinstance(n, (exp.Case, exp.If)) for n in nodes),
        has_exists=any(isinstance(n, exp.Exists) for n in nodes),
        has_order_by=any(q.args.get("order") for q in queries),
        has_limit=any(q.args.get("limit") for q in queries),
    )


def structural_descriptor(sql: str | exp.Expression) -> str:
    """Compact, stable cell descriptor of ``sql``, e.g. ``"j1|d0|AGG,GB,OB,LIM"``."""
    return describe_sql(sql).key


def is_aggregate(node: exp.Expression) -> bool:
    """True for a row-collapsing aggregate call; ``f(...) OVER (...)`` is a window, not an AGG."""
    if isinstance(node.parent, exp.Window) and node.arg_key == "this":
        return False
    if isinstance(node, exp.AggFunc):
        return True
    return isinstance(node, exp.Anonymous) and str(node.name).lower() in SQLITE_AGGREGATES


def select_depth(select: exp.Expression) -> int:
    """Number of SELECTs enclosing ``select``; CTE bodies count at their owner's depth."""
    depth = 0
    current = select.parent
    while current is not None:
        if isinstance(current, exp.CTE):
            owner = current.parent.parent if current.parent is not None else None  # CTE -> With -> query
            current = owner.parent if owner is not None else None  # the owner itself is a peer
            continue
        if isinstance(current, exp.Select):
            depth += 1
        current = current.parent
    return depth
