"""Math descriptors for EliteReplay: approach vocabulary, keyword labeler, answer-form descriptor.
The math verifier is :mod:`verl_replay.verifiers.math`, next to the SQL
one; the math readers are in :mod:`verl_replay.data` (``math_benchmarks``, ``tiny_math``).
Names resolve lazily, like :mod:`verl_replay.sql`.
"""

from __future__ import annotations

from verl_replay._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    name: "verl_replay.math.descriptor"
    for name in (
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
    )
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
