"""Pull the final answer out of a model response: SQL for text-to-SQL, LaTeX/number for math.

These functions are pure string processing (no sqlglot, no sympy) so the reward path can call
them on every response cheaply. They return ``None`` when no answer can be found; the
verifiers turn that into a failed verification with reason ``"no_sql"`` / ``"no_answer"``.
"""

from __future__ import annotations

import re

__all__ = [
    "extract_boxed",
    "extract_math_answer",
    "extract_sql",
    "strip_think",
]

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"

# ```sql ... ``` (closing fence optional: a response cut at max length still counts)
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_SQL_START_RE = re.compile(r"^[ \t]*(SELECT|WITH)\b", re.IGNORECASE | re.MULTILINE)


def strip_think(text: str) -> str | None:
    """Drop a Qwen-style reasoning prefix.

    Returns the text after the last ``</think>``. Chat templates that open ``<think>`` in the
    prompt leave only the closing tag in the response, so a lone ``</think>`` is handled the
    same way. A ``<think>`` that is never closed means the response was cut off mid-reasoning:
    whatever looks like an answer in there is a draft, so we return ``None`` rather than
    reward it.
    """
    close = text.rfind(_THINK_CLOSE)
    if close >= 0:
        return text[close + len(_THINK_CLOSE) :]
    if _THINK_OPEN in text:
        return None
    return text


def _clean_sql(sql: str) -> str | None:
    sql = sql.strip()
    # Trailing semicolons (possibly several, possibly separated by whitespace) are noise;
    # a semicolon *inside* the text is kept so the verifier can refuse multiple statements.
    while sql.endswith(";"):
        sql = sql[:-1].rstrip()
    return sql or None


def _sql_from_lines(text: str) -> str | None:
    """The last statement that starts a line with SELECT/WITH, up to ``;`` or a blank line."""
    starts = list(_SQL_START_RE.finditer(text))
    if not starts:
        return None
    tail = text[starts[-1].start() :]
    lines: list[str] = []
    for line in tail.splitlines():
        if not line.strip():
            break
        semi = line.find(";")
        if semi >= 0:
            lines.append(line[:semi])
            break
        lines.append(line)
    return _clean_sql("\n".join(lines))


def extract_sql(response_text: str | None) -> str | None:
    """Extract the SQL query a response proposes.

    Order of preference: the last fenced block tagged ``sql``; else the last fenced block of
    any language; else the last line starting with SELECT/WITH (continued until ``;`` or a
    blank line). A ``<think>...</think>`` prefix is ignored. Trailing semicolons and
    whitespace are stripped. Returns ``None`` when nothing usable is found.
    """
    if not isinstance(response_text, str):
        return None
    body = strip_think(response_text)
    if body is None:
        return None
    fences = list(_FENCE_RE.finditer(body))
    sql_fences = [m for m in fences if m.group(1).lower() in ("sql", "sqlite")]
    for group in (sql_fences, fences):
        for m in reversed(group):
            cleaned = _clean_sql(m.group(2))
            if cleaned is not None:
                return cleaned
    return _sql_from_lines(body)


_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_BARE_RE = re.compile(r"\\boxed[ \t]+([^\s$]+)")


_BRACE_TOKEN_RE = re.compile(r"\\[{}]|[{}]")


def _closing_braces(text: str) -> dict[int, int]:
    """Index of the matching ``}`` for every ``{`` that has one, in one pass over the text.

    An escaped brace ``\\{`` / ``\\}`` is content, not structure. One pass matters: a
    response cut off in a loop of ``\\boxed{`` (thousands of unclosed boxes) made a scan per
    box take 15 s for 28 KB.
    """
    closing: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACE_TOKEN_RE.finditer(text):
        token = m.group()
        if token == "{":
            stack.append(m.start())
        elif token == "}" and stack:
            closing[stack.pop()] = m.start()
    return closing


def extract_boxed(text: str | None) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``.

    Nested braces are matched (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``). An unbalanced
    last box (response cut off) falls back to the previous balanced one. ``\\boxed 5``
    (no braces) is accepted when it is the last box. Returns ``None`` when there is none.
    Linear in the length of ``text``.
    """
    if not isinstance(text, str):
        return None
    candidates: list[tuple[int, str]] = []
    closing: dict[int, int] | None = None
    for m in _BOXED_RE.finditer(text):
        if closing is None:
            closing = _closing_braces(text)
        open_index = m.end() - 1
        close = closing.get(open_index)
        if close is not None:
            candidates.append((m.start(), text[open_index + 1 : close].strip()))
    for m in _BOXED_BARE_RE.finditer(text):
        candidates.append((m.start(), m.group(1).strip()))
    if not candidates:
        return None
    return max(candidates, key=lambda c: c[0])[1]


# Fallback candidates when there is no box; the one that ends last wins.
# Math segments, as the regex  \$\$(.+?)\$\$ | \$([^$]+?)\$ | \\\((.+?)\\\) | \\\[(.+?)\\\]
# (DOTALL) would find them with finditer -- but in linear time: a failed lazy match scans to
# the end of the text, and a regex retries it at every later opener (1 s for 20 KB of
# "\\( x "). Here a delimiter with no closer left is never searched again.
_SEGMENT_OPENERS = ("$", "\\(", "\\[")


def _math_segments(text: str) -> list[tuple[int, str]]:
    """``(end, content)`` of every math segment, leftmost-first and non-overlapping."""
    found: list[tuple[int, str]] = []
    dead: set[str] = set()  # closers that do not occur any more after the current position
    next_at = {opener: text.find(opener) for opener in _SEGMENT_OPENERS}
    pos = 0
    while True:
        for opener in _SEGMENT_OPENERS:
            if 0 <= next_at[opener] < pos:
                next_at[opener] = text.find(opener, pos)
        starts = [i for i in next_at.values() if i >= 0]
        if not starts:
            return found
        p = min(starts)
        end = -1
        if text[p] == "$":
            if text.startswith("$$", p) and "$$" not in dead:
                q = text.find("$$", p + 3)  # at least one character inside
                if q < 0:
                    dead.add("$$")
                else:
                    end, content = q + 2, text[p + 2 : q]
            if end < 0 and p + 1 < len(text) and text[p + 1] != "$" and "$" not in dead:
                q = text.find("$", p + 1)
                if q < 0:
                    dead.add("$")
                else:
                    end, content = q + 1, text[p + 1 : q]
        else:
            closer = "\\)" if text[p + 1] == "(" else "\\]"
            if closer not in dead:
                q = text.find(closer, p + 3)
                if q < 0:
                    dead.add(closer)
                else:
                    end, content = q + 2, text[p + 2 : q]
        if end < 0:
            pos = p + 1
        else:
            found.append((end, content))
            pos = end


_FRAC_RE = re.compile(r"-?\\[dt]?frac\{[^{}]+\}\{[^{}]+\}")
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?%?|-?\.\d+%?")


def extract_math_answer(text: str | None) -> str | None:
    """The final answer of a math response as a string (not parsed).

    ``\\boxed{}`` content when present; otherwise the last number or LaTeX expression in the
    text (a ``$...$`` / ``\\(...\\)`` / ``\\[...\\]`` segment, a ``\\frac{}{}``, or a plain number,
    whichever ends last). For a math segment containing ``=``, the right-hand side of the last
    ``=`` is the answer (``$x = 5$`` -> ``5``). A ``<think>`` prefix is ignored.
    """
    if not isinstance(text, str):
        return None
    body = strip_think(text)
    if body is None:
        return None
    boxed = extract_boxed(body)
    if boxed:
        return boxed
    best: tuple[int, int, str] | None = None  # (end, length, answer)

    def consider(end: int, answer: str) -> None:
        nonlocal best
        answer = answer.strip()
        if answer and (best is None or (end, len(answer)) > best[:2]):
            best = (end, len(answer), answer)

    for end, segment in _math_segments(body):
        consider(end, segment.rsplit("=", 1)[-1])
    for m in _FRAC_RE.finditer(body):
        consider(m.end(), m.group(0))
    for m in _NUMBER_RE.finditer(body):
        consider(m.end(), m.group(0))
    return None if best is None else best[2]
