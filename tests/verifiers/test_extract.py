from __future__ import annotations

import random
import re

import pytest
from load_tolerant import assert_cpu_time_scales

from verl_replay.verifiers import extract
from verl_replay.verifiers.extract import (
    extract_boxed,
    extract_math_answer,
    extract_sql,
    strip_think,
)


class TestExtractSql:
    def test_prefers_last_sql_fence(self) -> None:
        text = "Draft:\n```sql\nSELECT 1;\n```\nFinal:\n```sql\nSELECT name\nFROM emp;\n```\nDone."
        assert extract_sql(text) == "SELECT name\nFROM emp"

    def test_sql_fence_beats_later_plain_fence(self) -> None:
        text = "```sql\nSELECT a FROM t\n```\nOutput:\n```\n| a |\n```"
        assert extract_sql(text) == "SELECT a FROM t"

    def test_plain_fence_when_no_sql_fence(self) -> None:
        assert extract_sql("Here:\n```\nSELECT a FROM t;\n```") == "SELECT a FROM t"

    def test_unclosed_fence_is_read_to_the_end(self) -> None:
        assert extract_sql("```sql\nSELECT a\nFROM t  ;  \n") == "SELECT a\nFROM t"

    def test_line_starting_with_select_or_with(self) -> None:
        text = "The query is:\nselect a\n  from t where a > 1;\nThat returns rows."
        assert extract_sql(text) == "select a\n  from t where a > 1"
        assert extract_sql("Answer:\nWITH c AS (SELECT 1) SELECT * FROM c") == "WITH c AS (SELECT 1) SELECT * FROM c"

    def test_line_statement_stops_at_blank_line(self) -> None:
        assert extract_sql("SELECT a FROM t\n\nThis selects a.") == "SELECT a FROM t"

    def test_strips_multiple_trailing_semicolons_but_keeps_inner_ones(self) -> None:
        assert extract_sql("```sql\nSELECT 1; DROP TABLE t;; ;\n```") == "SELECT 1; DROP TABLE t"

    def test_think_prefix_is_ignored(self) -> None:
        text = "<think>maybe ```sql\nSELECT wrong FROM t\n``` hmm</think>\n```sql\nSELECT right FROM t\n```"
        assert extract_sql(text) == "SELECT right FROM t"
        # chat templates that open <think> in the prompt leave only the closing tag
        assert extract_sql("reasoning...</think>SELECT a FROM t") == "SELECT a FROM t"

    def test_unclosed_think_yields_nothing(self) -> None:
        assert extract_sql("<think>```sql\nSELECT a FROM t\n```") is None

    @pytest.mark.parametrize("text", ["", "no query here", "```sql\n;\n```", None, 42])
    def test_nothing_usable(self, text: object) -> None:
        assert extract_sql(text) is None  # type: ignore[arg-type]


class TestExtractBoxed:
    def test_nested_braces(self) -> None:
        assert extract_boxed(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
        assert extract_boxed(r"\boxed{\left\{1, \{2\}\right\}}") == r"\left\{1, \{2\}\right\}"

    def test_last_box_wins(self) -> None:
        assert extract_boxed(r"\boxed{1} then \boxed{ 2 }") == "2"

    def test_unbalanced_last_box_falls_back_to_previous(self) -> None:
        assert extract_boxed(r"\boxed{3} and finally \boxed{\frac{1}{2}") == "3"

    def test_fbox_and_bare_box(self) -> None:
        assert extract_boxed(r"\fbox{7}") == "7"
        assert extract_boxed(r"the answer is \boxed 5.") == "5."

    def test_none(self) -> None:
        assert extract_boxed("no box") is None
        assert extract_boxed(None) is None


class TestExtractMathAnswer:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            (r"Thus \boxed{42}.", "42"),
            ("The answer is 17.", "17"),
            ("We get 3 apples, then 1,250 total", "1,250"),
            (r"So $x = \frac{3}{4}$.", r"\frac{3}{4}"),
            (r"It equals \frac{1}{2}", r"\frac{1}{2}"),
            (r"between 2 and \(\sqrt{2}\)", r"\sqrt{2}"),
            ("ratio 3/4", "3/4"),
            ("-0.5 is it", "-0.5"),
            (r"<think>try \boxed{1}</think> final \boxed{2}", "2"),
        ],
    )
    def test_answers(self, text: str, expected: str) -> None:
        assert extract_math_answer(text) == expected

    def test_nothing(self) -> None:
        assert extract_math_answer("no numbers at all") is None
        assert extract_math_answer("<think>unfinished 42") is None


def test_strip_think() -> None:
    assert strip_think("a</think>b</think>c") == "c"
    assert strip_think("plain") == "plain"
    assert strip_think("<think>open") is None


# --------------------------------------------------------------------------- linear time
# The previous implementations (regex with lazy quantifiers, one brace scan per box): same
# results, quadratic time on degenerate responses. Kept here as the reference.
_OLD_SEGMENT_RE = re.compile(r"\$\$(?P<a>.+?)\$\$|\$(?P<b>[^$]+?)\$|\\\((?P<c>.+?)\\\)|\\\[(?P<d>.+?)\\\]", re.DOTALL)


def _old_segments(text: str) -> list[tuple[int, str]]:
    return [(m.end(), next(g for g in m.groups() if g is not None)) for m in _OLD_SEGMENT_RE.finditer(text)]


def _old_balanced_from(text: str, open_index: int) -> str | None:
    depth = 0
    i = open_index
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i]
        i += 1
    return None


def _old_boxed(text: str) -> str | None:
    candidates = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        content = _old_balanced_from(text, m.end() - 1)
        if content is not None:
            candidates.append((m.start(), content.strip()))
    for m in re.finditer(r"\\boxed[ \t]+([^\s$]+)", text):
        candidates.append((m.start(), m.group(1).strip()))
    return max(candidates, key=lambda c: c[0])[1] if candidates else None


_PIECES = [
    "$",
    "$$",
    "\\(",
    "\\)",
    "\\[",
    "\\]",
    "{",
    "}",
    "\\{",
    "\\}",
    "\\",
    "\\boxed{",
    "\\boxed ",
    "\\fbox{",
    "x",
    "1",
    " ",
    "=",
    "\n",
    "2/3",
    "\\frac{1}{2}",
]


def test_linear_scanners_agree_with_the_regex_reference() -> None:
    rng = random.Random(1234)
    for _ in range(4000):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 30)))
        assert extract._math_segments(text) == _old_segments(text), text
        assert extract_boxed(text) == _old_boxed(text), text


@pytest.mark.parametrize(
    ("piece", "repeats", "tail"),
    [
        ("\\boxed{", 20000, ""),  # 140 KB of unclosed boxes: 15 s per 28 KB before
        ("\\( x ", 20000, ""),
        ("\\[ x ", 20000, ""),
        ("$$ x ", 20000, ""),
        ("{", 50000, "\\boxed{1}"),
    ],
    ids=["boxes", "parens", "brackets", "dollars", "braces"],
)
def test_degenerate_responses_are_linear(piece: str, repeats: int, tail: str) -> None:
    """CPU time from a quarter of the size to the whole grows like the size (a quadratic scan
    would grow 16x); measured as this process's CPU time, so a loaded machine cannot fail it."""

    def extract_both(n: int):
        text = piece * n + tail
        return lambda: (extract_math_answer(text), extract_sql(text))

    assert_cpu_time_scales(extract_both, repeats // 4, repeats)
