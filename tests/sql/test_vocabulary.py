"""Vocabulary YAML validation, saving, and LLM induction helpers."""

from __future__ import annotations

import warnings

import pytest
import yaml

from verl_replay.sql.vocabulary import (
    DEFAULT_SQL_VOCABULARY_PATH,
    Approach,
    UnreviewedVocabularyWarning,
    Vocabulary,
    VocabularyError,
    induce_vocabulary,
    load_vocabulary,
    normalise_approach_name,
    parse_induction_answer,
    save_vocabulary,
)


def _write(tmp_path, data) -> str:
    path = tmp_path / "vocab.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return str(path)


def _valid() -> dict:
    return {
        "domain": "sql",
        "reviewed": True,
        "default": "join",
        "approaches": [{"name": "join", "description": "Joins."}, {"name": "cte", "description": "WITH."}],
    }


def test_packaged_vocabulary_loads_without_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vocab = load_vocabulary()
    assert vocab == load_vocabulary(DEFAULT_SQL_VOCABULARY_PATH)
    assert len(vocab) == 12 and all(a.description.strip() for a in vocab)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["approaches"].append({"name": "join", "description": "again"}), "more than once"),
        (lambda d: d["approaches"][0].update(description="  "), "non-empty"),
        (lambda d: d["approaches"][0].pop("description"), "non-empty"),
        (lambda d: d["approaches"][0].update(name="Nested Subquery"), "e.g. 'nested_subquery'"),
        (lambda d: d.update(default="plain"), "default 'plain' is not one of"),
        (lambda d: d.pop("default"), "'default' is missing"),
        (lambda d: d.update(approaches=[]), "non-empty list"),
        (lambda d: d.update(reviwed=True), "unknown top-level key"),
        (lambda d: d["approaches"][1].update(desc="x"), r"approaches\[1\]: unknown key"),
        (lambda d: d.update(domain="chess"), "domain 'chess'"),
        (lambda d: d["approaches"][0].update(count=-1), "count must be"),
    ],
)
def test_invalid_files_give_clear_errors(tmp_path, mutate, message) -> None:
    data = _valid()
    mutate(data)
    with pytest.raises(VocabularyError, match=message):
        load_vocabulary(_write(tmp_path, data))


def test_error_names_the_file(tmp_path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("approaches: [unclosed", encoding="utf-8")
    with pytest.raises(VocabularyError, match="broken.yaml"):
        load_vocabulary(path)
    with pytest.raises(VocabularyError, match="cannot read"):
        load_vocabulary(tmp_path / "missing.yaml")
    data = _valid()
    data["default"] = "nope"
    with pytest.raises(VocabularyError, match=r"vocab\.yaml: default 'nope'"):
        load_vocabulary(_write(tmp_path, data))


def test_unreviewed_vocabulary_warns(tmp_path) -> None:
    data = _valid()
    data["reviewed"] = False
    with pytest.warns(UnreviewedVocabularyWarning, match="reviewed: true"):
        vocab = load_vocabulary(_write(tmp_path, data))
    assert not vocab.reviewed


def test_save_roundtrip_and_hash(tmp_path) -> None:
    vocab = Vocabulary(
        approaches=(Approach("join", "Joins.", count=3, examples=("SELECT 1",)), Approach("cte", "WITH.")),
        default="cte",
        reviewed=True,
    )
    path = save_vocabulary(vocab, tmp_path / "sub" / "v.yaml", induction={"num_items": 3})
    loaded = load_vocabulary(path)
    assert loaded == vocab
    assert loaded.content_hash() == vocab.content_hash()
    recounted = Vocabulary(approaches=(Approach("join", "Joins."), Approach("cte", "WITH.")), default="cte")
    assert recounted.content_hash() == vocab.content_hash()  # counts/examples are not label semantics
    reworded = Vocabulary(approaches=(Approach("join", "Joins tables."), Approach("cte", "WITH.")), default="cte")
    assert reworded.content_hash() != vocab.content_hash()
    assert not list(path.parent.glob(".v.yaml.*"))  # no temp file left behind


def test_vocabulary_object_validation() -> None:
    with pytest.raises(VocabularyError, match="more than once"):
        Vocabulary(approaches=(Approach("a", "x."), Approach("a", "y.")), default="a")
    vocab = Vocabulary(approaches=(Approach("a", "x."), Approach("b", "y.")), default="b")
    assert "a" in vocab and "c" not in vocab
    assert vocab.description("b") == "y."
    assert vocab.prompt_listing() == "- a: x.\n- b: y."
    with pytest.raises(KeyError, match="not in the vocabulary"):
        vocab.description("c")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Nested Subqueries", "nested_subquery"),
        ("join-based approach", "join"),
        ("1. Self Joins", "self_join"),
        ("window functions", "window_function"),
        ("EXISTS check", "exists_check"),
        ("`CTE`", "cte"),
        ("  ", None),
        ("the approach", None),
    ],
)
def test_normalise_approach_name(raw: str, expected: str | None) -> None:
    assert normalise_approach_name(raw) == expected


def test_parse_induction_answer_formats() -> None:
    assert parse_induction_answer("name: Correlated Subqueries\ndescription: Uses EXISTS.") == (
        "correlated_subquery",
        "Uses EXISTS.",
    )
    assert parse_induction_answer('<think>...</think>{"name": "CTE pipeline", "description": "Stages."}') == (
        "cte_pipeline",
        "Stages.",
    )
    assert parse_induction_answer("**Name:** join tables\n**Description:** Joins two tables.") == (
        "join_table",
        "Joins two tables.",
    )
    assert parse_induction_answer("Self join") == ("self_join", "")
    assert parse_induction_answer("This query selects rows from the table that match the filter.") is None
    assert parse_induction_answer("") is None


def test_induce_vocabulary_merges_counts_and_caps(scripted_backend) -> None:
    answers = {
        "q1": "name: Join Tables\ndescription: Joins two tables.",
        "q2": "name: tables_join\ndescription: Combines tables.",
        "q3": "name: join tables\ndescription: Joins two tables.",
        "q4": "name: Nested Subqueries\ndescription: Uses IN (SELECT).",
        "q5": "name: nested subquery\ndescription: Uses IN (SELECT).",
        "q6": "name: window\ndescription: Uses OVER.",
        "q7": "sorry, I cannot answer that question about this query today",
    }
    items = {
        "q1": "SELECT a FROM t JOIN u ON t.x = u.x -- q1",
        "q2": "SELECT a FROM t JOIN u ON 1 = 1 -- q2",
        "q3": "SELECT a FROM t JOIN u ON t.x = u.x -- q1",  # duplicate text of q1
        "q4": "SELECT a FROM t WHERE a IN (SELECT a FROM u) -- q4",
        "q5": "SELECT a FROM t WHERE a IN (SELECT b FROM u WHERE c > 1) -- q5",
        "q6": "SELECT RANK() OVER () FROM t -- q6",
        "q7": "SELECT 1 -- q7",
    }

    def answer(content: str) -> str:
        return next(answers[k] for k in answers if f"-- {k}\n" in content)

    backend = scripted_backend(answer)
    result = induce_vocabulary(list(items.values()), backend, max_approaches=2, examples_per_approach=2, batch_size=4)
    vocab = result.vocabulary
    assert vocab.names == ("join_table", "nested_subquery")
    assert [a.count for a in vocab] == [3, 2]
    assert vocab.description("join_table") == "Joins two tables."
    assert vocab.approaches[0].examples == (items["q2"], items["q1"])  # shortest distinct first
    assert vocab.default == "join_table" and not vocab.reviewed
    assert result.dropped == {"window": 1}
    assert result.unparsed == 1 and result.num_items == 7
    assert result.variants["join_table"] == ["join_table", "table_join"]
    assert [c["num_prompts"] for c in backend.calls] == [4, 3]


def test_induce_vocabulary_with_no_usable_answer(scripted_backend) -> None:
    backend = scripted_backend(lambda _: "I am not sure what strategy this query is using at all.")
    with pytest.raises(VocabularyError, match="no usable approach"):
        induce_vocabulary(["SELECT 1"], backend)


def test_saved_vocabulary_gets_the_users_umask(tmp_path) -> None:
    import stat

    from verl_replay._files import default_file_mode

    vocab = Vocabulary(approaches=(Approach("join", "Joins."), Approach("cte", "WITH.")), default="cte", reviewed=True)
    path = save_vocabulary(vocab, tmp_path / "v.yaml")
    assert stat.S_IMODE(path.stat().st_mode) == default_file_mode() != 0o600
