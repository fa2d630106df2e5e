"""Math approach labeler and answer-form / length descriptors."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from verl_replay.generation.base import Generation, GenerationBackend
from verl_replay.math.descriptor import (
    ANSWER_FORMS,
    MATH_KEYWORDS,
    MathDescriptor,
    MathKeywordLabeler,
    answer_form,
    default_math_vocabulary,
    describe_math,
    extract_final_answer,
    length_bucket,
    math_descriptor,
)
from verl_replay.sql.labeler import LLMLabeler
from verl_replay.sql.vocabulary import Approach, Vocabulary, VocabularyError


def test_vocabulary_is_reviewed_and_every_non_default_name_has_keywords() -> None:
    vocab = default_math_vocabulary()
    assert vocab.domain == "math" and vocab.reviewed and vocab.default == "numeric_computation"
    assert set(vocab.names) - {vocab.default} == set(MATH_KEYWORDS)
    assert {"algebraic", "casework", "geometric", "substitution", "counting"} <= set(vocab.names)


@pytest.mark.parametrize(
    ("solution", "expected"),
    [
        ("Case 1: $x \\ge 0$. Case 2: $x < 0$. In the second case there is no solution.", "casework"),
        ("Let $u = x^2$. Substituting gives $u^2 - 5u + 4 = 0$.", "substitution"),
        ("The number of ways is $\\binom{6}{2} = 15$ since we choose 2 of 6.", "counting"),
        ("Each of the 36 outcomes is equally likely, so the probability is $\\frac{1}{6}$.", "probability"),
        ("Since $7 \\equiv 1 \\pmod 3$, the remainder is 1.", "number_theory"),
        ("The derivative is $f'(x) = 2x$, which vanishes at 0.", "calculus"),
        ("Using $\\sin^2 x + \\cos^2 x = 1$ we get $\\tan x = 1$.", "trigonometric"),
        ("The triangle has a right angle, so by Pythagoras the area is 6.", "geometric"),
        (
            "By AM-GM, $a + b \\ge 2\\sqrt{ab}$; the minimum value is 4 and equality holds at a=b.",
            "inequality_bounding",
        ),
        ("We solve the equation $2x + 3 = 7$ and get $x = 2$.", "algebraic"),
        ("$12 \\cdot 7 = 84$, plus 16 is 100.", "numeric_computation"),
    ],
)
def test_keyword_labels(solution: str, expected: str) -> None:
    assert MathKeywordLabeler().label(solution) == expected


def test_scores_count_distinct_patterns_and_ties_follow_vocabulary_order() -> None:
    labeler = MathKeywordLabeler()
    repeated = "solve solve solve solve. The probability is one third."
    assert labeler.scores(repeated)["algebraic"] == 1  # one pattern, however often it occurs
    assert labeler.all_labels(repeated) == ["probability", "algebraic"]  # 1:1 tie, probability first
    strong = "We solve the quadratic equation by factoring; the probability is 1/2."
    assert labeler.all_labels(strong)[0] == "algebraic"  # 4 algebraic patterns beat 1
    assert labeler.label_batch(["2+2=4", repeated]) == ["numeric_computation", "probability"]


def test_custom_vocabulary_and_keywords() -> None:
    vocab = Vocabulary(
        approaches=(Approach("telescoping", "Cancels consecutive terms."), Approach("other", "Anything else.")),
        default="other",
        domain="math",
    )
    labeler = MathKeywordLabeler(vocab, keywords={"telescoping": [r"\btelescop\w*"]})
    assert labeler.label("The sum telescopes to 1 - 1/n.") == "telescoping"
    assert labeler.label("Direct computation.") == "other"
    with pytest.raises(VocabularyError, match="no vocabulary name has keywords"):
        MathKeywordLabeler(vocab)


class _Answers(GenerationBackend):
    def __init__(self, text: str) -> None:
        self.text = text

    @property
    def tokenizer(self) -> None:
        return None

    def generate(self, prompts: Sequence, **kwargs) -> list[list[Generation]]:
        return [[Generation(text=self.text, token_ids=(0,), finish_reason="stop")] for _ in prompts]


def test_llm_labeler_accepts_the_math_vocabulary() -> None:
    vocab = default_math_vocabulary()
    solution = "Case 1: n even. Case 2: n odd. In both cases the answer is $\\boxed{3}$."
    picked = LLMLabeler(_Answers("I would call it casework."), vocab)
    assert picked.label(solution) == "casework" and picked.num_fallbacks == 0
    unusable = LLMLabeler(_Answers("hmm"), vocab)
    assert unusable.label(solution) == "casework" and unusable.num_fallbacks == 1  # keyword fallback


@pytest.mark.parametrize(
    ("answer", "form"),
    [
        ("42", "integer"),
        ("-1,000", "integer"),
        ("$7$", "integer"),
        ("x = -3", "integer"),
        ("90^\\circ", "integer"),
        ("5 \\text{ cm}", "integer"),
        ("0.25", "decimal"),
        ("\\frac{3}{4}", "fraction"),
        ("-\\dfrac{1}{2}", "fraction"),
        ("3/4", "fraction"),
        ("2\\sqrt{3}", "radical"),
        ("\\frac{\\sqrt{3}}{2}", "radical"),
        ("\\frac{\\pi}{4}", "constant"),
        ("3 + 4i", "complex"),
        ("x^2 + 1", "expression"),
        ("2^{10}", "expression"),
        ("y = 2x + 3", "equation"),
        ("x \\le 3", "inequality"),
        ("(-\\infty, 2]", "interval"),
        ("[1, 3]", "interval"),
        ("(1, 2)", "tuple"),
        ("1, 2, 3", "list"),
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "matrix"),
        ("\\text{(B)}", "text"),
        ("", "none"),
        (None, "none"),
    ],
)
def test_answer_forms(answer: str | None, form: str) -> None:
    assert answer_form(answer) == form
    assert form in ANSWER_FORMS


def test_extract_final_answer_takes_the_last_balanced_box() -> None:
    text = "First \\boxed{1} then finally \\boxed{\\frac{\\sqrt{3}}{2}} done."
    assert extract_final_answer(text) == "\\frac{\\sqrt{3}}{2}"
    assert extract_final_answer("no box here") is None
    assert extract_final_answer("\\boxed{unclosed") is None


def test_length_buckets() -> None:
    assert [length_bucket(x) for x in (0, 127, 128, 255, 256, 511, 512, 10_000)] == [
        "L0",
        "L0",
        "L1",
        "L1",
        "L2",
        "L2",
        "L3",
        "L3",
    ]
    assert length_bucket(5, edges=(10,)) == "L0" and length_bucket(10, edges=(10,)) == "L1"
    with pytest.raises(ValueError, match="strictly increasing"):
        length_bucket(5, edges=(10, 10))
    with pytest.raises(ValueError, match=">= 0"):
        length_bucket(-1)


def test_descriptor_from_solution_tokens_or_words() -> None:
    solution = "We compute carefully. " * 50 + "So the answer is $\\boxed{\\frac{1}{2}}$."
    d = describe_math(solution)
    assert isinstance(d, MathDescriptor)
    assert d == MathDescriptor(form="fraction", length_bucket="L1")  # 155 words
    assert math_descriptor(solution, num_tokens=600) == "fraction|L3"
    assert math_descriptor(solution, answer="0.5", num_tokens=10) == "decimal|L0"
    assert math_descriptor("no final answer", num_tokens=1) == "none|L0"
