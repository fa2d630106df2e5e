"""Tiny text-to-SQL RL dataset over real SQLite databases (deterministic from a seed).

Two databases with primary and foreign keys (``shop``: customers, products, orders;
``school``: students, courses, enrollments) and template questions whose answers can be written
with different strategies (JOIN, IN-subquery, EXISTS, NOT EXISTS / LEFT JOIN anti-join, CTE,
GROUP BY/HAVING, correlated or scalar subquery, ORDER BY/LIMIT, INTERSECT, window function).
Every alternative of a question is executed at build time; a question is kept only if all its
alternatives run, agree as sets of rows, and give a non-trivial (non-empty, not all NULL/0)
answer. ``SQLExample.gold_sqls`` holds the alternatives; the first is the canonical gold query.
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_replay.data.schema import SQLExample, execute_readonly

TINY_SQL_SOURCE = "tiny_sql"
DB_IDS = ("shop", "school")

_PEOPLE = (
    "Alice",
    "Bob",
    "Carol",
    "Dan",
    "Eve",
    "Frank",
    "Grace",
    "Heidi",
    "Ivan",
    "Judy",
    "Ken",
    "Lena",
    "Mia",
    "Nick",
    "Olga",
    "Paul",
)
_CITIES = ("Paris", "Berlin", "Rome", "Madrid", "Oslo")
_PRODUCTS = ("pen", "book", "lamp", "mug", "desk", "chair", "bag", "cap", "ball", "clock", "kite", "vase")
_CATEGORIES = ("office", "home", "sport")
_COURSES = (
    "Algebra",
    "Biology",
    "Chemistry",
    "Drawing",
    "Economics",
    "French",
    "Geometry",
    "History",
    "Music",
    "Physics",
)
_DEPTS = ("math", "science", "arts")

SHOP_DDL = (
    "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL)",
    "CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, price INTEGER NOT "
    "NULL)",
    "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id), "
    "product_id INTEGER NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL, day INTEGER NOT NULL)",
)
SCHOOL_DDL = (
    "CREATE TABLE students (id INTEGER PRIMARY KEY, name TEXT NOT NULL, year INTEGER NOT NULL)",
    "CREATE TABLE courses (id INTEGER PRIMARY KEY, title TEXT NOT NULL, dept TEXT NOT NULL, credits INTEGER NOT NULL)",
    "CREATE TABLE enrollments (student_id INTEGER NOT NULL REFERENCES students(id), "
    "course_id INTEGER NOT NULL REFERENCES courses(id), grade INTEGER NOT NULL, "
    "PRIMARY KEY (student_id, course_id))",
)

Rows = dict[str, list[tuple[Any, ...]]]
Candidate = tuple[str, list[str]]  # question, equivalent gold queries


@dataclass(frozen=True)
class _Template:
    name: str
    db_id: str
    make: Callable[[Rows], list[Candidate]]


def _shop_rows(rng: random.Random) -> Rows:
    names = rng.sample(_PEOPLE, 12)
    customers = [(i + 1, names[i], rng.choice(_CITIES)) for i in range(12)]
    prices = rng.sample(range(3, 60), 10)  # distinct prices: "most expensive" has one answer
    products = [(i + 1, name, rng.choice(_CATEGORIES), prices[i]) for i, name in enumerate(rng.sample(_PRODUCTS, 10))]
    # Two customers and two products never appear in orders, so anti-join questions have answers.
    buyers = rng.sample([c[0] for c in customers], 10)
    sold = rng.sample([p[0] for p in products], 8)
    orders = [(i + 1, rng.choice(buyers), rng.choice(sold), rng.randint(1, 5), rng.randint(1, 28)) for i in range(36)]
    return {"customers": customers, "products": products, "orders": orders}


def _school_rows(rng: random.Random) -> Rows:
    names = rng.sample(_PEOPLE, 14)
    students = [(i + 1, names[i], rng.randint(1, 4)) for i in range(14)]
    courses = [(i + 1, title, rng.choice(_DEPTS), rng.randint(2, 6)) for i, title in enumerate(rng.sample(_COURSES, 8))]
    taught = rng.sample([c[0] for c in courses], 7)  # one course has no students
    enrollments = []
    for sid, _, _ in students:
        for cid in sorted(rng.sample(taught, rng.randint(1, 4))):
            enrollments.append((sid, cid, rng.randint(50, 100)))
    return {"students": students, "courses": courses, "enrollments": enrollments}


def _shop_templates() -> list[_Template]:
    cat_join = "FROM orders o JOIN products p ON p.id = o.product_id"

    def city_customers(r: Rows) -> list[Candidate]:
        cities = sorted({c[2] for c in r["customers"]})
        return [(f"Which customers live in {c}?", [f"SELECT name FROM customers WHERE city = '{c}'"]) for c in cities]

    def city_count(r: Rows) -> list[Candidate]:
        cities = sorted({c[2] for c in r["customers"]})
        return [
            (f"How many customers live in {c}?", [f"SELECT COUNT(*) FROM customers WHERE city = '{c}'"]) for c in cities
        ]

    def bought_category(r: Rows) -> list[Candidate]:
        return [
            (
                f"Which customers bought a {cat} product?",
                [
                    f"SELECT DISTINCT c.name FROM customers c JOIN orders o ON o.customer_id = c.id "
                    f"JOIN products p ON p.id = o.product_id WHERE p.category = '{cat}'",
                    f"SELECT name FROM customers WHERE id IN (SELECT o.customer_id {cat_join} WHERE p.category = "
                    f"'{cat}')",
                    f"SELECT c.name FROM customers c WHERE EXISTS (SELECT 1 {cat_join} "
                    f"WHERE o.customer_id = c.id AND p.category = '{cat}')",
                ],
            )
            for cat in _CATEGORIES
        ]

    def city_orders(r: Rows) -> list[Candidate]:
        cities = sorted({c[2] for c in r["customers"]})
        return [
            (
                f"How many orders were placed by customers from {c}?",
                [
                    f"SELECT COUNT(*) FROM orders o JOIN customers c ON c.id = o.customer_id WHERE c.city = '{c}'",
                    f"SELECT COUNT(*) FROM orders WHERE customer_id IN (SELECT id FROM customers WHERE city = '{c}')",
                ],
            )
            for c in cities
        ]

    def never_ordered(r: Rows) -> list[Candidate]:
        return [
            (
                "Which products have never been ordered?",
                [
                    "SELECT name FROM products WHERE id NOT IN (SELECT product_id FROM orders)",
                    "SELECT p.name FROM products p WHERE NOT EXISTS (SELECT 1 FROM orders o WHERE o.product_id = p.id)",
                    "SELECT p.name FROM products p LEFT JOIN orders o ON o.product_id = p.id WHERE o.id IS NULL",
                ],
            ),
            (
                "Which customers have not placed any order?",
                [
                    "SELECT name FROM customers WHERE id NOT IN (SELECT customer_id FROM orders)",
                    "SELECT c.name FROM customers c WHERE NOT EXISTS (SELECT 1 FROM orders o WHERE o.customer_id = "
                    "c.id)",
                    "SELECT name FROM customers EXCEPT SELECT c.name FROM customers c JOIN orders o ON "
                    "o.customer_id = c.id",
                ],
            ),
        ]

    def many_orders(r: Rows) -> list[Candidate]:
        return [
            (
                f"Which customers placed more than {n} orders?",
                [
                    "SELECT c.name FROM customers c JOIN orders o ON o.customer_id = c.id GROUP BY c.id HAVING "
                    f"COUNT(*) > {n}",
                    "SELECT name FROM customers c WHERE (SELECT COUNT(*) FROM orders o WHERE o.customer_id = c.id) "
                    f"> {n}",
                ],
            )
            for n in range(2, 6)
        ]

    def category_quantity(r: Rows) -> list[Candidate]:
        return [
            (
                f"What is the total quantity of {cat} products ordered?",
                [
                    f"SELECT SUM(o.quantity) {cat_join} WHERE p.category = '{cat}'",
                    "SELECT SUM(quantity) FROM orders WHERE product_id IN (SELECT id FROM products WHERE category "
                    f"= '{cat}')",
                ],
            )
            for cat in _CATEGORIES
        ]

    def most_expensive(r: Rows) -> list[Candidate]:
        return [
            (
                f"What is the most expensive {cat} product?",
                [
                    f"SELECT name FROM products WHERE category = '{cat}' ORDER BY price DESC LIMIT 1",
                    f"SELECT name FROM products WHERE category = '{cat}' "
                    f"AND price = (SELECT MAX(price) FROM products WHERE category = '{cat}')",
                ],
            )
            for cat in _CATEGORIES
        ]

    def big_spenders(r: Rows) -> list[Candidate]:
        return [
            (
                f"Which customers spent more than {x} in total?",
                [
                    f"WITH spend AS (SELECT o.customer_id, SUM(o.quantity * p.price) AS total {cat_join} "
                    f"GROUP BY o.customer_id) SELECT c.name FROM customers c JOIN spend s ON s.customer_id = c.id "
                    f"WHERE s.total > {x}",
                    f"SELECT c.name FROM customers c JOIN orders o ON o.customer_id = c.id "
                    f"JOIN products p ON p.id = o.product_id GROUP BY c.id HAVING SUM(o.quantity * p.price) > {x}",
                ],
            )
            for x in (150, 250, 400)
        ]

    def above_average(r: Rows) -> list[Candidate]:
        return [
            (
                "Which products cost more than the average price?",
                [
                    "SELECT name FROM products WHERE price > (SELECT AVG(price) FROM products)",
                    "WITH a AS (SELECT AVG(price) AS v FROM products) SELECT p.name FROM products p, a WHERE "
                    "p.price > a.v",
                ],
            )
        ]

    def both_categories(r: Rows) -> list[Candidate]:
        pairs = [(a, b) for i, a in enumerate(_CATEGORIES) for b in _CATEGORIES[i + 1 :]]
        return [
            (
                f"Which customers bought both {a} and {b} products?",
                [
                    "SELECT c.name FROM customers c JOIN orders o ON o.customer_id = c.id JOIN products p ON p.id "
                    "= o.product_id "
                    f"WHERE p.category = '{a}' INTERSECT SELECT c.name FROM customers c JOIN orders o ON "
                    "o.customer_id = c.id "
                    f"JOIN products p ON p.id = o.product_id WHERE p.category = '{b}'",
                    f"SELECT c.name FROM customers c WHERE EXISTS (SELECT 1 {cat_join} WHERE o.customer_id = c.id "
                    f"AND p.category = '{a}') AND EXISTS (SELECT 1 {cat_join} WHERE o.customer_id = c.id AND "
                    f"p.category = '{b}')",
                ],
            )
            for a, b in pairs
        ]

    makers = [
        city_customers,
        city_count,
        bought_category,
        city_orders,
        never_ordered,
        many_orders,
        category_quantity,
        most_expensive,
        big_spenders,
        above_average,
        both_categories,
    ]
    return [_Template(f"shop.{m.__name__}", "shop", m) for m in makers]


def _school_templates() -> list[_Template]:
    enrolled = "FROM students s JOIN enrollments e ON e.student_id = s.id JOIN courses c ON c.id = e.course_id"

    def titles(r: Rows) -> list[str]:
        return sorted(c[1] for c in r["courses"])

    def in_course(r: Rows) -> list[Candidate]:
        return [
            (
                f"Which students are enrolled in {t}?",
                [
                    f"SELECT s.name {enrolled} WHERE c.title = '{t}'",
                    f"SELECT name FROM students WHERE id IN (SELECT e.student_id FROM enrollments e "
                    f"JOIN courses c ON c.id = e.course_id WHERE c.title = '{t}')",
                    f"SELECT s.name FROM students s WHERE EXISTS (SELECT 1 FROM enrollments e JOIN courses c "
                    f"ON c.id = e.course_id WHERE e.student_id = s.id AND c.title = '{t}')",
                ],
            )
            for t in titles(r)
        ]

    def average_grade(r: Rows) -> list[Candidate]:
        return [
            (
                f"What is the average grade in {t}?",
                [
                    "SELECT AVG(e.grade) FROM enrollments e JOIN courses c ON c.id = e.course_id WHERE c.title = "
                    f"'{t}'",
                    "SELECT AVG(grade) FROM enrollments WHERE course_id = (SELECT id FROM courses WHERE title = "
                    f"'{t}')",
                ],
            )
            for t in titles(r)
        ]

    def busy_students(r: Rows) -> list[Candidate]:
        return [
            (
                f"Which students take more than {n} courses?",
                [
                    "SELECT s.name FROM students s JOIN enrollments e ON e.student_id = s.id GROUP BY s.id HAVING "
                    f"COUNT(*) > {n}",
                    "SELECT name FROM students s WHERE (SELECT COUNT(*) FROM enrollments e WHERE e.student_id = "
                    f"s.id) > {n}",
                ],
            )
            for n in (1, 2, 3)
        ]

    def empty_courses(r: Rows) -> list[Candidate]:
        return [
            (
                "Which courses have no students?",
                [
                    "SELECT title FROM courses WHERE id NOT IN (SELECT course_id FROM enrollments)",
                    "SELECT c.title FROM courses c WHERE NOT EXISTS (SELECT 1 FROM enrollments e WHERE e.course_id "
                    "= c.id)",
                    "SELECT c.title FROM courses c LEFT JOIN enrollments e ON e.course_id = c.id WHERE "
                    "e.student_id IS NULL",
                ],
            )
        ]

    def year_dept(r: Rows) -> list[Candidate]:
        return [
            (
                f"Which year {y} students take a {d} course?",
                [
                    f"SELECT DISTINCT s.name {enrolled} WHERE s.year = {y} AND c.dept = '{d}'",
                    f"SELECT name FROM students WHERE year = {y} AND id IN (SELECT e.student_id FROM enrollments e "
                    f"JOIN courses c ON c.id = e.course_id WHERE c.dept = '{d}')",
                ],
            )
            for y in range(1, 5)
            for d in _DEPTS
        ]

    def top_dept(r: Rows) -> list[Candidate]:
        return [
            (
                "Which department offers the most credits in total?",
                [
                    "SELECT dept FROM courses GROUP BY dept ORDER BY SUM(credits) DESC LIMIT 1",
                    "WITH t AS (SELECT dept, SUM(credits) AS total FROM courses GROUP BY dept) "
                    "SELECT dept FROM t WHERE total = (SELECT MAX(total) FROM t)",
                ],
            )
        ]

    def high_grades(r: Rows) -> list[Candidate]:
        return [
            (
                f"Which students got a grade above {g} in a {d} course?",
                [
                    f"SELECT DISTINCT s.name {enrolled} WHERE c.dept = '{d}' AND e.grade > {g}",
                    f"SELECT s.name FROM students s WHERE EXISTS (SELECT 1 FROM enrollments e JOIN courses c "
                    f"ON c.id = e.course_id WHERE e.student_id = s.id AND c.dept = '{d}' AND e.grade > {g})",
                ],
            )
            for g in (80, 90)
            for d in _DEPTS
        ]

    def dept_count(r: Rows) -> list[Candidate]:
        return [
            (
                f"How many students take a {d} course?",
                [
                    f"SELECT COUNT(DISTINCT e.student_id) FROM enrollments e JOIN courses c ON c.id = e.course_id "
                    f"WHERE c.dept = '{d}'",
                    f"SELECT COUNT(*) FROM students WHERE id IN (SELECT e.student_id FROM enrollments e "
                    f"JOIN courses c ON c.id = e.course_id WHERE c.dept = '{d}')",
                ],
            )
            for d in _DEPTS
        ]

    def best_in_course(r: Rows) -> list[Candidate]:
        return [
            (
                f"Which student has the highest grade in {t}?",
                [
                    f"SELECT s.name {enrolled} WHERE c.title = '{t}' ORDER BY e.grade DESC LIMIT 1",
                    f"SELECT s.name {enrolled} WHERE c.title = '{t}' AND e.grade = (SELECT MAX(e2.grade) "
                    f"FROM enrollments e2 JOIN courses c2 ON c2.id = e2.course_id WHERE c2.title = '{t}')",
                ],
            )
            for t in titles(r)
        ]

    def best_grade_per_student(r: Rows) -> list[Candidate]:
        return [
            (
                f"What is the best grade of each year {y} student?",
                [
                    f"SELECT s.name, MAX(e.grade) FROM students s JOIN enrollments e ON e.student_id = s.id "
                    f"WHERE s.year = {y} GROUP BY s.id",
                    f"SELECT DISTINCT s.name, MAX(e.grade) OVER (PARTITION BY s.id) FROM students s "
                    f"JOIN enrollments e ON e.student_id = s.id WHERE s.year = {y}",
                ],
            )
            for y in range(1, 5)
        ]

    makers = [
        in_course,
        average_grade,
        busy_students,
        empty_courses,
        year_dept,
        top_dept,
        high_grades,
        dept_count,
        best_in_course,
        best_grade_per_student,
    ]
    return [_Template(f"school.{m.__name__}", "school", m) for m in makers]


def _write_database(path: Path, ddl: tuple[str, ...], rows: Rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA foreign_keys = ON")  # rows must satisfy the declared keys
        for statement in ddl:
            conn.execute(statement)
        for table, table_rows in rows.items():
            marks = ", ".join("?" * len(table_rows[0]))
            conn.executemany(f"INSERT INTO {table} VALUES ({marks})", table_rows)
        conn.commit()
    finally:
        conn.close()


def _informative(rows: list[tuple[Any, ...]]) -> bool:
    """Non-empty and not a lone NULL/0 aggregate (those make a degenerate reward signal)."""
    return bool(rows) and not all(v in (None, 0) for row in rows for v in row)


def _accept(db_path: Path, sqls: list[str]) -> bool:
    results = [set(execute_readonly(db_path, sql)) for sql in sqls]
    first = results[0]
    return _informative(list(first)) and all(r == first for r in results[1:])


def database_path(db_root: Path, db_id: str) -> Path:
    """BIRD/Spider-style location ``<db_root>/<db_id>/<db_id>.sqlite``."""
    return Path(db_root) / db_id / f"{db_id}.sqlite"


def build_tiny_sql(
    db_root: Path,
    *,
    seed: int = 0,
    n_train: int = 48,
    n_val: int = 12,
    final_db_root: Path | None = None,
) -> dict[str, list[SQLExample]]:
    """Write the databases under ``db_root`` and return ``{"train": [...], "val": [...]}``.

    ``final_db_root`` is where the databases will live once the caller moves the build into
    place (the examples' ``db_path`` points there); defaults to ``db_root``.
    """
    rng = random.Random(f"tiny-sql-{seed}")
    data = {"shop": (SHOP_DDL, _shop_rows(rng)), "school": (SCHOOL_DDL, _school_rows(rng))}
    for db_id, (ddl, rows) in data.items():
        _write_database(database_path(db_root, db_id), ddl, rows)

    pools: list[list[tuple[str, str, list[str]]]] = []
    for template in _shop_templates() + _school_templates():
        db_path = database_path(db_root, template.db_id)
        accepted = [
            (template.db_id, q, sqls) for q, sqls in template.make(data[template.db_id][1]) if _accept(db_path, sqls)
        ]
        rng.shuffle(accepted)
        if accepted:
            pools.append(accepted)

    # Round-robin over templates so every strategy family is represented in both splits.
    total = n_train + n_val
    chosen: list[tuple[str, str, list[str]]] = []
    while len(chosen) < total and any(pools):
        for pool in pools:
            if pool and len(chosen) < total:
                chosen.append(pool.pop())
    if len(chosen) < total:
        raise RuntimeError(f"tiny SQL seed {seed} yields only {len(chosen)} verified questions, need {total}")
    rng.shuffle(chosen)

    final_root = Path(final_db_root) if final_db_root is not None else Path(db_root)
    examples = [
        SQLExample(
            question_id=f"{TINY_SQL_SOURCE}-{i:04d}",
            db_id=db_id,
            question=question,
            gold_sqls=tuple(sqls),
            db_path=database_path(final_root, db_id).absolute(),
        )
        for i, (db_id, question, sqls) in enumerate(chosen)
    ]
    return {"train": examples[:n_train], "val": examples[n_train:]}
