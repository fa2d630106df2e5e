"""Math archive-cell descriptors.

* Approach: a reviewed vocabulary (:data:`MATH_APPROACHES`) and a deterministic keyword labeler
  over the solution text (:class:`MathKeywordLabeler`). Each approach has a few regular
  expressions; its score is the number of *distinct* patterns found (repeating one word does
  not add up), the label is the best score, ties go to the earlier approach in
  :data:`MATH_APPROACHES` (more specific techniques first), and no hit gives the default
  ``numeric_computation``. An :class:`verl_replay.sql.labeler.LLMLabeler` accepts this
  vocabulary too (its fallback is then this labeler).
* Descriptor: the *form* of the final answer (:func:`answer_form`: integer, fraction, radical,
  interval, ...) plus a *length bucket* of the solution, as ``"fraction|L1"``. Within one
  question the correct answers share one value, so the form varies only with how the solution
  writes it (``0.5`` vs ``\\frac{1}{2}``, ``2\\sqrt{2}`` vs ``\\sqrt{8}`` both radical); the
  length bucket is what separates short derivations from long ones. Lengths are token counts
  when the caller passes them (the archive does), otherwise whitespace-separated words; use
  one unit for one archive.

Stdlib only; the answer form is a syntactic classification, not a math-verify parse.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from verl_replay.sql.vocabulary import Approach, Vocabulary, VocabularyError

__all__ = [
    "ANSWER_FORMS",
    "DEFAULT_LENGTH_EDGES",
    "MATH_APPROACHES",
    "MATH_KEYWORDS",
    "MathDescriptor",
    "MathKeywordLabeler",
    "answer_form",
    "default_math_vocabulary",
    "describe_math",
    "extract_final_answer",
    "length_bucket",
    "math_descriptor",
]

# name -> one-line description (prompt text); order = tie-break precedence of the keyword labeler.
MATH_APPROACHES: tuple[tuple[str, str], ...] = (
    ("casework", "Splits the problem into exhaustive cases and handles each case separately."),
    ("substitution", "Introduces a new variable or substitutes an expression to simplify the problem."),
    ("counting", "Counts arrangements or selections with combinatorial formulas (permutations, binomials)."),
    ("probability", "Computes a probability or expected value from outcomes and their likelihoods."),
    ("number_theory", "Uses divisibility, primes, remainders or modular arithmetic."),
    ("calculus", "Uses derivatives, integrals or limits."),
    ("trigonometric", "Uses trigonometric functions and identities."),
    ("geometric", "Reasons about figures: lengths, angles, areas, similar triangles, coordinates of points."),
    ("inequality_bounding", "Bounds the quantity with an inequality (AM-GM, Cauchy-Schwarz) to find an extremum."),
    ("algebraic", "Sets up equations or manipulates algebraic expressions (solving, factoring, expanding)."),
    ("numeric_computation", "Evaluates the quantity directly by arithmetic, without a named technique."),
)

_I = re.IGNORECASE
MATH_KEYWORDS: dict[str, tuple[str, ...]] = {
    "casework": (
        r"\bcasework\b",
        r"\bcase\s*(?:\d+|[ivx]+)\b",
        r"\b(?:first|second|third|other|remaining) case\b",
        r"\b(?:two|three|four|several|these) cases\b",
        r"\bconsider (?:the )?cases?\b",
    ),
    "substitution": (
        r"\bsubstitut\w*",
        r"\blet\s+\$?\s*[uvtyw]\s*=",
        r"\bplug(?:ging)?\s+in\b",
        r"\bchange of variables?\b",
    ),
    "counting": (
        r"\\binom\b",
        r"\bchoose\b",
        r"\bpermutations?\b",
        r"\bcombinations?\b",
        r"\barrangements?\b",
        r"\bnumber of ways\b",
        r"\d\s*!",
    ),
    "probability": (
        r"\bprobability\b",
        r"\bexpected value\b",
        r"\bequally likely\b",
        r"\boutcomes?\b",
        r"\bat random\b",
    ),
    "number_theory": (
        r"\\pmod\b|\\mod\b|\bmodulo\b",
        r"\bdivisib\w*|\bdivides\b",
        r"\bremainder\b",
        r"\bprimes?\b",
        r"\bgcd\b|\\gcd\b|\blcm\b",
        r"\\equiv\b",
        r"\bdivisors?\b",
    ),
    "calculus": (
        r"\bderivative\b",
        r"\\int\b|\bintegra(?:l|te)\b",
        r"\\lim\b|\blimit\b",
        r"\bf'\(|\\frac\{d\w*\}\{d\w\}",
    ),
    "trigonometric": (
        r"\\(?:sin|cos|tan|cot|sec|csc)\b",
        r"\btrig\w*",
        r"\bradians?\b",
        r"\\arc(?:sin|cos|tan)\b",
    ),
    "geometric": (
        r"\btriangles?\b",
        r"\bcircles?\b|\bradius\b|\bdiameter\b",
        r"\bangles?\b",
        r"\barea\b|\bperimeter\b",
        r"\bpythagore\w*",
        r"\bsimilar\b|\bcongruent\b",
        r"\bpolygon\b|\bsquare with side\b|\brectangle\b",
    ),
    "inequality_bounding": (
        r"\bam-gm\b|\bam[ -]gm\b",
        r"\bcauchy",
        r"\bminimum value\b|\bmaximum value\b",
        r"\bequality (?:holds|occurs)\b",
        r"\bbounded?\b",
    ),
    "algebraic": (
        r"\bsolv\w*",
        r"\bequations?\b",
        r"\bfactor\w*",
        r"\bexpand\w*",
        r"\bquadratic\b",
        r"\bpolynomial\b",
        r"\bsimplif\w*",
    ),
}


def default_math_vocabulary() -> Vocabulary:
    """The reviewed math approach vocabulary (catch-all: ``numeric_computation``)."""
    return Vocabulary(
        approaches=tuple(Approach(name, description) for name, description in MATH_APPROACHES),
        default="numeric_computation",
        domain="math",
        reviewed=True,
    )


class MathKeywordLabeler:
    """Deterministic keyword labeler for math solutions (scoring rule in the module docstring)."""

    def __init__(
        self,
        vocabulary: Vocabulary | None = None,
        keywords: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.vocabulary = vocabulary if vocabulary is not None else default_math_vocabulary()
        table = MATH_KEYWORDS if keywords is None else keywords
        self._patterns = {
            name: tuple(re.compile(p, _I) for p in table[name]) for name in self.vocabulary.names if name in table
        }
        if not self._patterns and len(self.vocabulary) > 1:
            raise VocabularyError(
                "MathKeywordLabeler: no vocabulary name has keywords; pass keywords={name: [regex, ...]}"
            )

    def scores(self, text: str) -> dict[str, int]:
        """Distinct-pattern hit count per approach that has keywords."""
        return {name: sum(1 for p in patterns if p.search(text)) for name, patterns in self._patterns.items()}

    def all_labels(self, text: str) -> list[str]:
        """Approaches with at least one hit, best first (ties: vocabulary order); else the default."""
        order = {name: i for i, name in enumerate(self.vocabulary.names)}
        hits = [(score, name) for name, score in self.scores(text).items() if score > 0]
        hits.sort(key=lambda item: (-item[0], order[item[1]]))
        return [name for _, name in hits] or [self.vocabulary.default]

    def label(self, text: str) -> str:
        return self.all_labels(text)[0]

    def label_batch(self, texts: Sequence[str]) -> list[str]:
        return [self.label(t) for t in texts]


# --------------------------------------------------------------------------------------------
# Answer form and length
# --------------------------------------------------------------------------------------------

ANSWER_FORMS = (
    "none",
    "integer",
    "decimal",
    "fraction",
    "radical",
    "constant",
    "complex",
    "expression",
    "equation",
    "inequality",
    "interval",
    "tuple",
    "list",
    "matrix",
    "text",
)
DEFAULT_LENGTH_EDGES: tuple[int, ...] = (128, 256, 512)


def extract_final_answer(solution: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces matched), else None."""
    last: str | None = None
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", solution):
        depth, start = 1, match.end()
        for i in range(start, len(solution)):
            char = solution[i]
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    last = solution[start:i]
                    break
    return last


_UNIT_SUFFIX = re.compile(r"\\(?:text|mbox|mathrm)\{\s*[a-zA-Z ]*\}\s*$")
_NUMBER = r"\d+(?:,\d{3})*"


def _normalise(answer: str) -> str:
    text = answer.strip().strip("$").strip()
    text = re.sub(r"\\(?:left|right|displaystyle|!|,|;|:)", "", text)
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"\^\s*\{?\\circ\}?|\\%|%|\\degree", "", text)
    if not re.fullmatch(r"\\(?:text|mbox|mathrm)\{[^{}]*\}", text):
        text = _UNIT_SUFFIX.sub("", text)  # "5 \text{ cm}" -> "5"
    text = re.sub(r"\s+", "", text)
    named = re.fullmatch(r"[a-zA-Z]=(.+)", text)
    if named and not re.search(r"[a-zA-Z]", re.sub(r"\\[a-zA-Z]+", "", named.group(1))):
        text = named.group(1)  # "x = 5" names the unknown; "y = 2x + 3" stays an equation
    return text


def _top_level_commas(text: str) -> int:
    depth, count = 0, 0
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            count += 1
    return count


def answer_form(answer: str | None) -> str:
    """Syntactic form of a final answer, one of :data:`ANSWER_FORMS`.

    ``(a, b)`` without infinity or mixed brackets is a ``tuple`` (a point), not an interval.
    """
    if answer is None:
        return "none"
    text = _normalise(answer)
    if not text:
        return "none"
    if re.search(r"\\begin\{[pbBvV]?matrix\}", text):
        return "matrix"
    if re.fullmatch(r"(?:\\(?:text|mbox|mathrm)\{[^{}]*\}|\([A-Ea-e]\))", text):
        return "text"
    bracketed_pair = re.fullmatch(r"[\[\(].*,.*[\]\)]", text) is not None
    if "\\infty" in text or "\\cup" in text or (bracketed_pair and (text[0] == "[" or text[-1] == "]")):
        return "interval"
    if "=" in text:
        return "equation"
    if re.search(r"<|>|\\le|\\ge|\\neq", text):
        return "inequality"
    if re.fullmatch(rf"[-+]?{_NUMBER}", text):
        return "integer"  # before "list": 1,000 is a thousands separator
    if re.fullmatch(r"[-+]?\d*\.\d+", text):
        return "decimal"
    if text[0] == "(" and text[-1] == ")" and _top_level_commas(text[1:-1]) > 0:
        return "tuple"
    if _top_level_commas(text) > 0 or text.startswith("\\{"):
        return "list"
    if re.fullmatch(r"[-+]?(?:\\frac\{[-+]?\d+\}\{\d+\}|\\frac\d\d|\d+/\d+)", text):
        return "fraction"
    letters = re.sub(r"\\[a-zA-Z]+", "", text)  # latex commands are not variables
    has_variables = re.search(r"[a-zA-Z]", letters) is not None
    if not has_variables:
        if "\\sqrt" in text:
            return "radical"
        if "\\pi" in text:
            return "constant"
        return "expression"
    if set(re.findall(r"[a-zA-Z]", letters)) == {"i"}:
        return "complex"
    return "expression"


def length_bucket(length: int, edges: Sequence[int] = DEFAULT_LENGTH_EDGES) -> str:
    """``"L0"`` for ``length < edges[0]``, ..., ``"L{len(edges)}"`` for ``length >= edges[-1]``."""
    if list(edges) != sorted(set(edges)):
        raise ValueError(f"length edges must be strictly increasing, got {list(edges)}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    return f"L{sum(length >= edge for edge in edges)}"


@dataclass(frozen=True)
class MathDescriptor:
    form: str
    length_bucket: str

    @property
    def key(self) -> str:
        return f"{self.form}|{self.length_bucket}"

    def __str__(self) -> str:
        return self.key


def describe_math(
    solution: str,
    *,
    answer: str | None = None,
    num_tokens: int | None = None,
    edges: Sequence[int] = DEFAULT_LENGTH_EDGES,
) -> MathDescriptor:
    """Descriptor of a solution; ``answer`` defaults to its last ``\\boxed{}`` content and the
    length to its whitespace word count when ``num_tokens`` is not given."""
    final = answer if answer is not None else extract_final_answer(solution)
    length = num_tokens if num_tokens is not None else len(solution.split())
    return MathDescriptor(form=answer_form(final), length_bucket=length_bucket(length, edges))


def math_descriptor(
    solution: str,
    *,
    answer: str | None = None,
    num_tokens: int | None = None,
    edges: Sequence[int] = DEFAULT_LENGTH_EDGES,
) -> str:
    """Compact cell descriptor, e.g. ``"fraction|L1"`` (see :func:`describe_math`)."""
    return describe_math(solution, answer=answer, num_tokens=num_tokens, edges=edges).key
