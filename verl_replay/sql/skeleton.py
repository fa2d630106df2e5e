"""Canonical AST skeleton of a SQL query: the *strategy identity* used by evaluation.

Two queries get the same skeleton iff they have the same shape after we forget *which* tables,
columns and constants they mention and *how* they were spelled. The pipeline is:

1. parse with sqlglot (sqlite dialect); anything that is not exactly one query
   (SELECT / set operation / WITH ... SELECT) raises :class:`SQLParseError`;
2. canonicalise names: table aliases, column (projection) aliases and subquery aliases are
   removed and column qualifiers are dropped, so ``T1.col`` / ``t.col`` / ``col`` coincide;
   every remaining table name becomes ``tbl`` and every other identifier becomes ``col``
   (quoting is dropped with the name);
3. literals (numbers, strings, negated numbers) become ``?``; an ``IN`` list made only of
   literals collapses to ``IN (?)`` because the number of listed constants is data, not strategy;
4. spelling-only variants are normalised: ``ASC`` (the default) is dropped, ``INNER JOIN`` is
   ``JOIN`` and ``LEFT OUTER JOIN`` is ``LEFT JOIN``, and parentheses that cannot change the
   parse (around atoms, a whole clause, a comparison inside AND/OR, an AND inside an AND) are
   removed;
5. operands of commutative operators are sorted by their rendered text, bottom-up: ``=``,
   ``!=``/``<>`` (symmetric, so swapping them never changes meaning) and flattened ``AND`` /
   ``OR`` chains;
6. render with sqlglot's sqlite generator (deterministic; keywords and function names upper case).

Deliberately *not* done (each would merge strategies the paper counts as distinct, or needs the
schema): sqlglot's optimizer (it rewrites subqueries into joins and so on), mirroring ``<``/``>``,
reordering ``+``/``*`` or projections, and resolving SQLite's fallback that reads an unknown
double-quoted identifier (``"2014"``) as a string: sqlglot parses it as a column, so
``x = "2014"`` and ``x = '2014'`` get different skeletons.
"""

from __future__ import annotations

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError

__all__ = ["SQLParseError", "parse_query", "sql_skeleton"]

DIALECT = "sqlite"
TABLE_PLACEHOLDER = "tbl"
NAME_PLACEHOLDER = "col"


class SQLParseError(ValueError):
    """The text is not exactly one SQL query that sqlglot can parse in the sqlite dialect."""


def parse_query(sql: str) -> exp.Expression:
    """Parse ``sql`` into one sqlglot query tree (sqlite dialect) or raise :class:`SQLParseError`.

    A trailing ``;`` is fine; several statements, an empty string, or a statement that is not a
    query (INSERT, CREATE, a bare expression, ...) are errors.
    """
    if not isinstance(sql, str):
        raise SQLParseError(f"expected SQL text, got {type(sql).__name__}")
    try:
        statements = [s for s in sqlglot.parse(sql, read=DIALECT) if s is not None]
    except (SqlglotError, RecursionError) as err:
        raise SQLParseError(f"cannot parse SQL ({type(err).__name__}): {_first_line(err)}") from err
    if not statements:
        raise SQLParseError("empty SQL: no statement found")
    if len(statements) > 1:
        raise SQLParseError(f"expected exactly one SQL statement, found {len(statements)}")
    tree = statements[0]
    if not isinstance(tree, exp.Query):
        raise SQLParseError(f"not a query (SELECT / set operation / WITH): parsed as {type(tree).__name__}")
    return tree


def sql_skeleton(sql: str) -> str:
    """Canonical skeleton of ``sql`` (see the module docstring); raises :class:`SQLParseError`."""
    tree = parse_query(sql)
    # Reverse pre-order visits every node after all of its descendants, so each rewrite sees
    # canonical children (sorting keys are the children's final rendering).
    for node in reversed(list(tree.dfs())):
        replacement = _canonicalise(node)
        if replacement is not node:
            if node is tree:
                tree = replacement
            else:
                node.replace(replacement)
    return tree.sql(dialect=DIALECT)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _canonicalise(node: exp.Expression) -> exp.Expression:
    """Return the canonical replacement of ``node`` (``node`` itself if edited in place)."""
    if isinstance(node, exp.Identifier):
        node.set("this", _identifier_placeholder(node))
        node.set("quoted", False)
    elif isinstance(node, exp.Column):
        for key in ("table", "db", "catalog"):
            node.set(key, None)
    elif isinstance(node, exp.Table):
        for key in ("db", "catalog", "alias"):
            node.set(key, None)
    elif isinstance(node, exp.Subquery):
        node.set("alias", None)
    elif isinstance(node, exp.Alias):
        return node.this
    elif isinstance(node, exp.Literal):
        return exp.Placeholder()
    elif isinstance(node, exp.Neg) and isinstance(node.this, exp.Placeholder):
        return node.this  # -5 is a literal too
    elif isinstance(node, exp.In):
        items = node.expressions
        if items and all(isinstance(i, exp.Placeholder) for i in items):
            node.set("expressions", [exp.Placeholder()])
    elif isinstance(node, exp.Ordered):
        if not node.args.get("desc"):
            node.set("desc", None)  # explicit ASC is the default
    elif isinstance(node, exp.Join):
        if (node.args.get("kind") or "").upper() in ("INNER", "OUTER"):
            node.set("kind", None)
    elif isinstance(node, exp.Paren):
        inner = node.this
        while isinstance(inner, exp.Paren):  # ((x)) -> (x), then judge against the real parent
            inner = inner.this
        if inner is not node.this:
            node.set("this", inner)
        if _paren_is_redundant(node):
            return node.this
    elif isinstance(node, (exp.EQ, exp.NEQ)):
        if _render(node.this) > _render(node.expression):
            left, right = node.this, node.expression
            node.set("this", right)
            node.set("expression", left)
    elif isinstance(node, (exp.And, exp.Or)):
        return _sorted_chain(node)
    return node


def _identifier_placeholder(ident: exp.Identifier) -> str:
    parent = ident.parent
    if isinstance(parent, exp.Table) and ident.arg_key == "this":
        return TABLE_PLACEHOLDER
    if isinstance(parent, exp.TableAlias) and ident.arg_key == "this":
        return TABLE_PLACEHOLDER  # CTE names (other table aliases are removed)
    return NAME_PLACEHOLDER


_ATOMS = (
    exp.Column,
    exp.Placeholder,
    exp.Literal,
    exp.Null,
    exp.Boolean,
    exp.Star,
    exp.Paren,
    exp.Subquery,
    exp.Window,
)
# Operators whose operands may need parentheses; any other parent (a clause, a function
# argument, a projection, ORDER BY item, ...) delimits its child on its own.
_OPERATORS = (exp.Binary, exp.Unary, exp.Predicate)
# Bind tighter than AND/OR in SQLite, so parentheses around them inside AND/OR are redundant.
_TIGHTER_THAN_CONNECTORS = (exp.Predicate, exp.Not, exp.Exists)


def _paren_is_redundant(paren: exp.Paren) -> bool:
    inner, parent = paren.this, paren.parent
    if _is_atom(inner) or not isinstance(parent, _OPERATORS):
        return True
    if isinstance(parent, exp.Connector):
        if isinstance(inner, exp.Connector):
            # same connector: associative; AND inside OR: AND binds tighter. OR inside AND stays.
            return type(inner) is type(parent) or (isinstance(inner, exp.And) and isinstance(parent, exp.Or))
        return isinstance(inner, _TIGHTER_THAN_CONNECTORS)
    return False


def _is_atom(node: exp.Expression) -> bool:
    # sqlglot models AND/OR (and a few other infix operators) as Func subclasses too; only
    # functions rendered as NAME(...) / CASE ... END are self-delimiting.
    if isinstance(node, _ATOMS):
        return True
    return isinstance(node, exp.Func) and not isinstance(node, _OPERATORS)


def _sorted_chain(node: exp.Connector) -> exp.Expression:
    operands = sorted(_flatten(node, type(node)), key=_render)
    chain = operands[0]
    for operand in operands[1:]:
        chain = type(node)(this=chain, expression=operand)
    return chain


def _flatten(node: exp.Expression, kind: type) -> list[exp.Expression]:
    if isinstance(node, exp.Paren) and type(node.this) is kind:
        node = node.this
    if type(node) is kind:
        return _flatten(node.this, kind) + _flatten(node.expression, kind)
    return [node]


def _render(node: exp.Expression) -> str:
    return node.sql(dialect=DIALECT)
