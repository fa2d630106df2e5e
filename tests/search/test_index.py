"""BM25 retrieval over a local corpus (real bm25s index, corpus files in tmp dirs)."""

from __future__ import annotations

import json

import pytest

from verl_replay.search.index import BM25Index, Document, format_results, read_corpus, write_corpus

DOCS = [
    Document("a", "Zib\nThe code of the zib is 47."),
    Document("b", "Mop\nThe mop lives in a blue house."),
    Document("c", "Kel\nThe kel is a small red bird that eats seeds."),
]


def test_the_document_naming_the_query_ranks_first():
    index = BM25Index(DOCS)
    hits = index.search(["where does the mop live", "zib code", "red bird"], topk=2)
    assert [hits[0][0][0].doc_id, hits[1][0][0].doc_id, hits[2][0][0].doc_id] == ["b", "a", "c"]
    assert all(len(row) == 2 for row in hits)
    assert hits[0][0][1] > hits[0][1][1]  # scores best first


def test_topk_is_capped_by_the_corpus_and_queries_without_known_terms_still_answer():
    index = BM25Index(DOCS)
    assert len(index.search(["zib"], topk=10)[0]) == 3
    assert len(index.search(["qqqq"], topk=1)[0]) == 1
    assert len(index.search([""], topk=1)[0]) == 1


def test_results_are_formatted_as_search_r1_formats_them():
    assert format_results(DOCS[:2]) == (
        "Doc 1(Title: Zib) The code of the zib is 47.\nDoc 2(Title: Mop) The mop lives in a blue house.\n"
    )


def test_corpus_round_trip_and_title_text_lines(tmp_path):
    path = write_corpus(DOCS, tmp_path / "corpus.jsonl")
    assert read_corpus(path) == DOCS
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": 7, "title": "T", "text": "body"}) + "\n\n")
    assert read_corpus(other) == [Document("7", "T\nbody")]


@pytest.mark.parametrize(
    "content, message",
    [("", "no documents"), ("{not json\n", "not JSON"), ('{"id": 1}\n', "needs 'contents'"), ("[1]\n", "JSON object")],
)
def test_bad_corpus_files_name_the_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_corpus(path)
    with pytest.raises(FileNotFoundError, match="no such corpus file"):
        read_corpus(tmp_path / "missing.jsonl")
