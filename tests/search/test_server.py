"""The Search-R1-style retrieval server over HTTP (a real server thread on a free port)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from verl_replay.search import server as srv
from verl_replay.search.index import BM25Index, Document, write_corpus

DOCS = [Document("a", "Zib\nThe code of the zib is 47."), Document("b", "Mop\nThe mop is blue.")]


@pytest.fixture
def url():
    httpd = srv.serve(BM25Index(DOCS), "127.0.0.1", 0, default_topk=1)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


def _post(url: str, body: object) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_retrieve_answers_in_search_r1_format(url):
    status, payload = _post(f"{url}/retrieve", {"queries": ["zib", "mop"], "topk": 1, "return_scores": True})
    assert status == 200
    assert [row[0]["document"]["id"] for row in payload["result"]] == ["a", "b"]
    assert payload["result"][0][0]["document"]["contents"].startswith("Zib\n")
    assert payload["result"][0][0]["score"] > 0
    status, payload = _post(f"{url}/retrieve", {"queries": ["mop"]})  # the server's default topk, no scores
    assert payload == {"result": [[{"id": "b", "contents": "Mop\nThe mop is blue."}]]}


def test_bad_requests_are_refused_with_a_reason(url):
    assert _post(f"{url}/retrieve", {"query": "zib"}) == (
        400,
        {"error": "the body must be a JSON object with a 'queries' list"},
    )
    status, payload = _post(f"{url}/search", {"queries": []})
    assert status == 404 and "POST /retrieve" in payload["error"]


def test_main_refuses_a_missing_corpus(tmp_path, capsys):
    assert srv.main(["--corpus", str(tmp_path / "none.jsonl")]) == 2
    assert "--corpus" in capsys.readouterr().err
    write_corpus(DOCS, tmp_path / "c.jsonl")  # a readable corpus builds an index
    assert len(BM25Index.from_file(tmp_path / "c.jsonl").docs) == 2
