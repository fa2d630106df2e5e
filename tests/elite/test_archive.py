"""EliteArchive on a small but real domain: integer arithmetic expressions.

The verifier evaluates an expression with an AST whitelist (``+ - * **``, unary minus,
integer literals) and compares it with the ground truth; the describer labels the approach
by the operators used and the descriptor by the nesting depth. The describer does not know
``**`` (a verified solution it cannot place: a parse failure) and labels a bare literal
"literal", which is outside the vocabulary.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_replay.elite.archive import (
    SEED_KEY,
    Candidate,
    CellKey,
    EliteArchive,
    FrozenArchive,
    InsertStatus,
    Question,
)

VOCAB = ["sum", "product", "difference", "mixed"]


@dataclass(frozen=True)
class Verdict:
    correct: bool
    reason: str


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Pow) and 0 <= right <= 8:
            return left**right
    raise ValueError(f"disallowed syntax {type(node).__name__}")


def verify(question: Question, text: str) -> Verdict:
    try:
        value = _eval(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as exc:
        return Verdict(False, f"not a valid expression: {exc}")
    if value == question.ground_truth:
        return Verdict(True, f"value {value} matches")
    return Verdict(False, f"value {value} != {question.ground_truth}")


def _ops_and_depth(node: ast.AST) -> tuple[set[str], int]:
    if isinstance(node, ast.Constant):
        return set(), 0
    if isinstance(node, ast.UnaryOp):
        ops, depth = _ops_and_depth(node.operand)
        return ops | {"neg"}, depth
    if isinstance(node, ast.BinOp):
        names = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul"}
        if type(node.op) not in names:
            raise ValueError(f"no approach label for operator {type(node.op).__name__}")
        lo, ld = _ops_and_depth(node.left)
        ro, rd = _ops_and_depth(node.right)
        return lo | ro | {names[type(node.op)]}, 1 + max(ld, rd)
    raise ValueError(f"cannot describe {type(node).__name__}")


def describe(question: Question, text: str) -> tuple[str, str]:
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as exc:
        raise ValueError(str(exc)) from None
    ops, depth = _ops_and_depth(tree)
    if not ops:
        approach = "literal"
    elif ops & {"sub", "neg"}:
        approach = "difference"
    elif ops == {"add"}:
        approach = "sum"
    elif ops == {"mul"}:
        approach = "product"
    else:
        approach = "mixed"
    return approach, f"depth={min(depth, 3)}"


def count_tokens(text: str) -> int:
    return len(re.findall(r"\d+|\S", text))


def make_archive(seed: int = 0, **overrides) -> EliteArchive:
    kwargs = dict(verifier=verify, describer=describe, token_counter=count_tokens, approaches=VOCAB, seed=seed)
    kwargs.update(overrides)
    return EliteArchive(**kwargs)


def q(qid: str, target: int) -> Question:
    return Question(
        id=qid, prompt=f"Write an expression equal to {target}.", ground_truth=target, metadata={"t": target}
    )


def cand(
    question: Question, text: str, requested: str | None = None, parent=None, finish_reason=None, **meta
) -> Candidate:
    return Candidate(
        question_id=question.id,
        text=text,
        requested_approach=requested,
        parent=parent,
        metadata=meta,
        finish_reason=finish_reason,
    )


OUTCOMES = ("truncated", "parse_failures", "verification_failures", "not_added", "new", "improved")


def assert_denominators(counts: dict) -> None:
    scopes = [counts["totals"], *counts["per_question"].values(), *counts["per_approach"].values()]
    scopes += [c for d in counts["per_question_approach"].values() for c in d.values()]
    for c in scopes:
        assert c["attempts"] == sum(c[k] for k in OUTCOMES)
        assert c["insertions"] == c["new"] + c["improved"]
        assert c["approach_misses"] <= c["not_added"] + c["new"] + c["improved"]
    for key in ("attempts", *OUTCOMES, "approach_misses"):
        total = counts["totals"][key]
        assert sum(c[key] for c in counts["per_question"].values()) == total
        assert sum(c[key] for c in counts["per_approach"].values()) == total
        assert sum(c[key] for d in counts["per_question_approach"].values() for c in d.values()) == total


# ---------------------------------------------------------------- the domain itself


def test_fake_domain_is_real():
    q12 = q("a", 12)
    assert verify(q12, "3*4").correct and not verify(q12, "3*5").correct
    assert not verify(q12, "__import__('os')").correct
    assert verify(q12, "2**3+4").correct
    assert describe(q12, "(1+2)*4") == ("mixed", "depth=2")
    assert describe(q12, "20-8") == ("difference", "depth=1")
    with pytest.raises(ValueError):
        describe(q12, "2**3+4")
    assert count_tokens("(10+2)") == 5


# ---------------------------------------------------------------- insertion rule


def test_unverified_never_enters_even_if_caller_claims_correct():
    arch = make_archive()
    q12 = q("a", 12)
    res = arch.insert(q12, cand(q12, "5+8", correct=True, reward=1.0, verified=True))
    assert res.status is InsertStatus.REJECTED and res.cell is None
    assert "13 != 12" in res.reason
    assert len(arch) == 0 and arch.elites() == []
    assert arch.counts()["totals"]["verification_failures"] == 1


def test_cut_off_generations_are_never_verified_or_inserted():
    calls = []

    def counting_verifier(question: Question, text: str) -> Verdict:
        calls.append(text)
        return verify(question, text)

    arch = make_archive(verifier=counting_verifier)
    q12 = q("a", 12)
    # "3*4" is correct -- but cut off by the length limit it may be the prefix of "3*4+1"
    for reason in ("length", "abort"):
        res = arch.insert(q12, cand(q12, "3*4", "product", finish_reason=reason))
        assert (res.status, res.cell, res.inserted) == (InsertStatus.TRUNCATED, None, False)
        assert repr(reason) in res.reason
    assert calls == [] and len(arch) == 0
    assert arch.insert(q12, cand(q12, "3*4", "product", finish_reason="stop")).status is InsertStatus.NEW
    assert arch.insert(q12, cand(q12, "4*3", "product")).status is InsertStatus.NOT_ADDED  # None: unknown, allowed
    assert calls == ["3*4", "4*3"]
    counts = arch.counts()
    assert counts["totals"]["truncated"] == 2 and counts["totals"]["attempts"] == 4
    assert counts["per_approach"]["product"]["truncated"] == 2  # counts towards choose_target's attempts
    assert_denominators(counts)
    with pytest.raises(TypeError, match="finish_reason"):
        cand(q12, "1", finish_reason=1)


def test_new_shorter_replaces_ties_keep_incumbent():
    arch = make_archive()
    q12 = q("a", 12)
    first = arch.insert(q12, cand(q12, "(10+1)+1", "sum"), round=0)
    assert first.status is InsertStatus.NEW and first.cell == CellKey("sum", "depth=2")
    tie = arch.insert(q12, cand(q12, "(9+2)+1", "sum"), round=1)  # same cell, same 7 tokens
    assert tie.status is InsertStatus.NOT_ADDED and "ties keep the incumbent" in tie.reason
    longer = arch.insert(q12, cand(q12, "((9+1))+2", "sum"), round=2)
    assert longer.status is InsertStatus.NOT_ADDED
    better = arch.insert(q12, cand(q12, "1+1+10", "sum", parent=("sum", "depth=2")), round=3)
    assert better.status is InsertStatus.IMPROVED and better.num_tokens == 5

    (elite,) = arch.elites("a")
    assert elite.text == "1+1+10" and elite.num_tokens == 5 and elite.insertion_round == 3
    assert elite.parent == CellKey("sum", "depth=2") and elite.verification_reason == "value 12 matches"
    other = arch.insert(q12, cand(q12, "7+5"), round=4)  # depth 1: a different cell
    assert other.status is InsertStatus.NEW and len(arch) == 2
    c = arch.counts()["totals"]
    assert (c["attempts"], c["new"], c["improved"], c["not_added"], c["insertions"]) == (5, 2, 1, 2, 3)


def test_achieved_cell_and_approach_miss():
    arch = make_archive()
    q12 = q("a", 12)
    res = arch.insert(q12, cand(q12, "7+5", "product"))
    assert res.status is InsertStatus.NEW and res.approach_miss
    elite = arch.elite("a", ("sum", "depth=1"))
    assert elite is not None and elite.requested_approach == "product" and elite.achieved_approach == "sum"
    assert elite.approach_miss
    hit = arch.insert(q12, cand(q12, "3*4", "product"))
    assert not hit.approach_miss
    counts = arch.counts()
    assert counts["totals"]["approach_misses"] == 1
    assert counts["per_approach"]["product"]["approach_misses"] == 1
    assert counts["per_approach"]["product"]["attempts"] == 2
    assert_denominators(counts)


def test_verification_before_parse_and_parse_failures():
    seen = []

    def counting_describer(question, text):
        seen.append(text)
        return describe(question, text)

    arch = make_archive(describer=counting_describer)
    q8 = q("a", 8)
    wrong_and_unlabelable = arch.insert(q8, cand(q8, "2**4"))  # 16: wrong, and "**" has no label
    assert wrong_and_unlabelable.status is InsertStatus.REJECTED
    assert seen == []  # the describer only sees verified solutions
    pow_ok = arch.insert(q8, cand(q8, "2**3", "product"))
    assert pow_ok.status is InsertStatus.PARSE_FAILED and "Pow" in pow_ok.reason
    literal = arch.insert(q8, cand(q8, "8"))
    assert literal.status is InsertStatus.PARSE_FAILED and "'literal'" in literal.reason
    assert len(arch) == 0
    c = arch.counts()
    assert c["totals"]["parse_failures"] == 2 and c["totals"]["verification_failures"] == 1
    assert c["totals"]["approach_misses"] == 0  # achieved approach unknown for parse failures
    assert c["per_approach"][SEED_KEY]["attempts"] == 2
    assert_denominators(c)


def test_describer_returning_none_is_a_parse_failure():
    arch = make_archive(describer=lambda question, text: None)
    q8 = q("a", 8)
    assert arch.insert(q8, cand(q8, "4+4")).status is InsertStatus.PARSE_FAILED


def test_invalid_inputs_and_buggy_callables():
    arch = make_archive()
    q8, q9 = q("a", 8), q("b", 9)
    with pytest.raises(ValueError, match="candidate is for question"):
        arch.insert(q8, cand(q9, "4+5"))
    with pytest.raises(ValueError, match="not in the vocabulary"):
        arch.insert(q8, cand(q8, "4+4", "recursion"))
    arch.insert(q8, cand(q8, "4+4"))
    with pytest.raises(ValueError, match="different content"):
        arch.insert(q("a", 7), cand(q8, "4+3"))

    before = arch.state_dict()

    def boom(question, text):
        raise RuntimeError("verifier crashed")

    broken = make_archive(verifier=boom)
    broken.load_state_dict(before)
    with pytest.raises(RuntimeError):
        broken.insert(q("new", 3), cand(q("new", 3), "1+2"))
    assert broken.state_dict() == before  # a raising callable changes nothing

    truthy = make_archive(verifier=lambda question, text: Verdict("yes", ""))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bool .correct"):
        truthy.insert(q8, cand(q8, "4+4"))
    zero = make_archive(token_counter=lambda text: 0)
    with pytest.raises(ValueError, match=">= 1"):
        zero.insert(q8, cand(q8, "4+4"))
    with pytest.raises(ValueError, match="reserved"):
        make_archive(approaches=["sum", SEED_KEY])
    with pytest.raises(ValueError, match="duplicates"):
        make_archive(approaches=["sum", "sum"])
    with pytest.raises(ValueError, match="seed"):
        make_archive(seed=-1)


# ---------------------------------------------------------------- counters (property)

_expr = st.recursive(
    st.integers(0, 9).map(str),
    lambda inner: st.tuples(inner, st.sampled_from("+-*"), inner, st.booleans()).map(
        lambda t: f"({t[0]}{t[1]}{t[2]})" if t[3] else f"{t[0]}{t[1]}{t[2]}"
    ),
    max_leaves=5,
)


@settings(max_examples=60, deadline=None)
@given(
    attempts=st.lists(
        st.tuples(st.integers(0, 2), _expr, st.sampled_from([None, *VOCAB]), st.sampled_from([None, "stop", "length"])),
        min_size=1,
        max_size=40,
    )
)
def test_archive_matches_reference_model_and_denominators_add_up(attempts):
    questions = [q("a", 6), q("b", 4), q("c", 0)]
    arch = make_archive(seed=3)
    reference: dict[tuple[str, CellKey], tuple[int, str]] = {}
    for i, (qi, text, requested, finish_reason) in enumerate(attempts):
        question = questions[qi]
        res = arch.insert(question, cand(question, text, requested, finish_reason=finish_reason), round=i)
        # independent reference: first finished, verified and placed solution per cell, replaced
        # only if shorter
        if finish_reason == "length":
            assert res.status is InsertStatus.TRUNCATED
            continue
        if not verify(question, text).correct:
            assert res.status is InsertStatus.REJECTED
            continue
        approach, descriptor = describe(question, text)
        if approach not in VOCAB:
            assert res.status is InsertStatus.PARSE_FAILED
            continue
        key = (question.id, CellKey(approach, descriptor))
        n = count_tokens(text)
        if key not in reference:
            expected = InsertStatus.NEW
        elif n < reference[key][0]:
            expected = InsertStatus.IMPROVED
        else:
            expected = InsertStatus.NOT_ADDED
        assert res.status is expected
        assert res.approach_miss == (requested is not None and requested != approach)
        if expected is not InsertStatus.NOT_ADDED:
            reference[key] = (n, text)

    got = {(e.question_id, e.cell): (e.num_tokens, e.text) for e in arch.elites()}
    assert got == reference
    assert len(arch) == len(reference)
    counts = arch.counts()
    assert counts["totals"]["attempts"] == len(attempts)
    assert counts["totals"]["insertions"] == counts["totals"]["new"] + counts["totals"]["improved"]
    assert counts["totals"]["new"] == len(reference)
    assert_denominators(counts)
    json.dumps(counts)  # JSON-ready (goes into the manifest)


# ---------------------------------------------------------------- choose_target / choose_parent


def test_choose_target_prefers_uncovered_approaches():
    arch = make_archive(seed=11)
    q12 = q("a", 12)
    arch.insert(q12, cand(q12, "7+5"))  # covers "sum"
    arch.insert(q12, cand(q12, "3*4"))  # covers "product"
    picks = {arch.choose_target("a") for _ in range(50)}
    assert picks == {"difference", "mixed"}  # both uncovered and tied: seeded tie-break reaches both
    ranking = arch.rank_targets("a")
    assert set(ranking[:2]) == {"difference", "mixed"} and set(ranking[2:]) == {"sum", "product"}


def test_choose_target_fewer_attempts_then_lower_cross_question_coverage():
    arch = make_archive(seed=5)
    qa, qb, qc = q("a", 12), q("b", 6), q("c", 8)
    # cross-question coverage: product covered by b and c, sum by b, difference and mixed by none
    arch.insert(qb, cand(qb, "2*3"))
    arch.insert(qb, cand(qb, "1+5"))
    arch.insert(qc, cand(qc, "2*4"))
    assert arch.coverage()["questions_per_approach"] == {"sum": 1, "product": 2, "difference": 0, "mixed": 0}
    # failed attempts at question a: two at "difference", one at "mixed", none at sum / product
    for text, requested in (("1", "difference"), ("2", "difference"), ("3", "mixed")):
        assert arch.insert(qa, cand(qa, text, requested)).status is InsertStatus.REJECTED
    # all uncovered for a; attempts (sum 0, product 0, mixed 1, difference 2); coverage sum 1 < product 2
    assert arch.rank_targets("a") == ["sum", "product", "mixed", "difference"]
    # question d: no attempts, nothing covered -> order by cross-question coverage, ties seeded
    ranks = [tuple(arch.rank_targets("d")) for _ in range(40)]
    assert {r[2:] for r in ranks} == {("sum", "product")}
    assert {r[:2] for r in ranks} == {("difference", "mixed"), ("mixed", "difference")}
    # uncovered beats fewer attempts: cover "sum" for a, it drops to the end despite 0 attempts
    arch.insert(qa, cand(qa, "6+6"))
    assert arch.rank_targets("a") == ["product", "mixed", "difference", "sum"]


def test_choose_target_tie_break_is_seeded():
    def sequence(seed):
        arch = make_archive(seed=seed)
        return [arch.choose_target(f"q{i}") for i in range(30)]

    assert sequence(1) == sequence(1)
    assert sequence(1) != sequence(2)
    firsts = [make_archive(seed=s).choose_target("x") for s in range(200)]
    counts = {a: firsts.count(a) for a in VOCAB}
    assert all(25 <= n <= 75 for n in counts.values()), counts  # ~uniform among the tied 4


def test_choose_parent_preference():
    arch = make_archive(seed=2)
    q12 = q("a", 12)
    assert arch.choose_parent("a", "sum") is None  # no elite at all
    arch.insert(q12, cand(q12, "7+5"))  # sum, depth=1
    arch.insert(q12, cand(q12, "(6+5)+1"))  # sum, depth=2
    # middle case: every elite has the target approach -> one of them (never None)
    same = {arch.choose_parent("a", "sum").text for _ in range(40)}
    assert same == {"7+5", "(6+5)+1"}
    arch.insert(q12, cand(q12, "3*4"))  # product
    arch.insert(q12, cand(q12, "20-8"))  # difference
    assert {arch.choose_parent("a", "sum").approach for _ in range(60)} == {"product", "difference"}
    assert {arch.choose_parent("a", "product").text for _ in range(80)} == {"7+5", "(6+5)+1", "20-8"}
    # parents never come from another question
    q9 = q("b", 9)
    assert arch.choose_parent("b", "sum") is None
    arch.insert(q9, cand(q9, "4+5"))
    assert arch.choose_parent("b", "product").question_id == "b"


def test_choose_parent_is_seeded():
    def picks(seed):
        arch = make_archive(seed=seed)
        q12 = q("a", 12)
        for text in ("7+5", "3*4", "20-8", "(1+2)*4"):
            arch.insert(q12, cand(q12, text))
        return [arch.choose_parent("a", "sum").text for _ in range(20)]

    assert picks(4) == picks(4)
    assert picks(4) != picks(5)


# ---------------------------------------------------------------- queries, freeze, state


def test_queries_and_coverage():
    arch = make_archive()
    qa, qb, qc = q("b", 12), q("a", 6), q("c", 1)
    arch.register(qc)  # known question without elites counts in the denominator
    arch.insert(qa, cand(qa, "7+5"))
    arch.insert(qa, cand(qa, "3*4"))
    arch.insert(qb, cand(qb, "2*3"))
    assert [x.id for x in arch.questions()] == ["a", "b", "c"]
    assert [(e.question_id, e.cell) for e in arch.elites()] == [
        ("a", ("product", "depth=1")),
        ("b", ("product", "depth=1")),
        ("b", ("sum", "depth=1")),
    ]
    assert arch.cells("b") == [("product", "depth=1"), ("sum", "depth=1")] and arch.cells("zzz") == []
    cov = arch.coverage()
    assert cov["questions"] == 3 and cov["questions_covered"] == 2 and cov["cells"] == 3 == len(arch)
    assert cov["mean_cells"] == pytest.approx(1.0)
    assert cov["cells_per_question"] == {"a": 1, "b": 2, "c": 0}


def test_freeze_is_immutable_and_sorted():
    arch = make_archive()
    qa = Question(id="a", prompt=[{"role": "user", "content": "make 12"}], ground_truth=12, metadata={"db": "x"})
    for text in ("3*4", "7+5", "20-8"):
        arch.insert(qa, cand(qa, text, temperature=0.7))
    frozen = arch.freeze(manifest={"k": [1, 2]})
    assert isinstance(frozen, FrozenArchive) and len(frozen) == 3
    assert [e.approach for e in frozen.entries] == ["difference", "product", "sum"]
    assert frozen.entries[0].prompt[0]["content"] == "make 12"
    with pytest.raises(AttributeError):
        frozen.foo = 1  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        frozen.entries[0].text = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        frozen.groups["a"][("sum", "depth=1")] = None  # type: ignore[index]
    with pytest.raises(TypeError):
        frozen.entries[0].prompt[0]["content"] = "changed"  # type: ignore[index]
    with pytest.raises(TypeError):
        frozen.manifest["k"] = 3  # type: ignore[index]
    with pytest.raises(ValueError):
        frozen.offsets[0] = 5
    assert frozen.entries[0].to_dict()["prompt"] == [{"role": "user", "content": "make 12"}]
    # mutating the live archive afterwards does not touch the snapshot
    arch.insert(qa, cand(qa, "(1+2)*4"))
    assert len(frozen) == 3 and len(arch) == 4


def _run_search(arch: EliteArchive, questions: list[Question], rounds: int, rng: np.random.Generator, log: list):
    """A miniature MAP-Elites loop driven by the archive's own choices."""
    for r in range(rounds):
        for question in questions:
            target = arch.choose_target(question.id)
            parent = arch.choose_parent(question.id, target)
            a, b = int(rng.integers(0, 10)), int(rng.integers(0, 10))
            op = {"sum": "+", "product": "*", "difference": "-", "mixed": "+"}[target]
            text = f"{a}{op}{b}" if target != "mixed" else f"({a}+{b})*{int(rng.integers(1, 3))}"
            res = arch.insert(question, cand(question, text, target, None if parent is None else parent.cell), round=r)
            log.append((target, None if parent is None else parent.text, res.status, res.cell))


def test_state_dict_resume_is_identical():
    questions = [q("a", 6), q("b", 8), q("c", 9), q("d", 4)]
    arch = make_archive(seed=9)
    gen = np.random.default_rng(0)
    head: list = []
    _run_search(arch, questions, 6, gen, head)
    state = json.loads(json.dumps(arch.state_dict()))  # must survive JSON
    gen_state = gen.bit_generator.state

    resumed = make_archive(seed=12345)  # seed is overridden by the state
    resumed.load_state_dict(state)
    assert resumed.counts() == arch.counts() and resumed.coverage() == arch.coverage()
    tail_a, tail_b = [], []
    _run_search(arch, questions, 8, gen, tail_a)
    gen2 = np.random.default_rng()
    gen2.bit_generator.state = gen_state
    _run_search(resumed, questions, 8, gen2, tail_b)
    assert tail_a == tail_b
    assert resumed.state_dict() == arch.state_dict()
    assert any(s in (InsertStatus.NEW, InsertStatus.IMPROVED) for _, _, s, _ in tail_a)

    with pytest.raises(ValueError, match="approaches"):
        make_archive(approaches=["sum", "product"]).load_state_dict(state)
    with pytest.raises(ValueError, match="not an EliteArchive state"):
        make_archive().load_state_dict({"format": "other"})
    old_version = {**state, "version": 1}  # before cut-off generations were refused
    with pytest.raises(ValueError, match="length limit"):
        make_archive().load_state_dict(old_version)
    bad = json.loads(json.dumps(state))
    bad["elites"].append(bad["elites"][0])
    keep = arch.state_dict()
    with pytest.raises(ValueError, match="two elites"):
        arch.load_state_dict(bad)
    assert arch.state_dict() == keep  # a refused state leaves the archive untouched
