"""LocalSearchTool as verl's tool registry builds it from a tool config (local index and server)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from verl_replay.search import server as srv
from verl_replay.search.index import SEARCH_TOOL_CLASS, SEARCH_TOOL_SCHEMA, BM25Index, Document, write_corpus

DOCS = [Document("a", "Zib\nThe code of the zib is 47."), Document("b", "Mop\nThe code of the mop is 12.")]


def _tools(tmp_path, config):
    from verl.tools.tool_registry import initialize_tools_from_config

    path = tmp_path / "tools.yaml"
    entry = {"class_name": SEARCH_TOOL_CLASS, "config": {"type": "native", **config}, "tool_schema": SEARCH_TOOL_SCHEMA}
    path.write_text(json.dumps({"tools": [entry]}))
    (tool,) = initialize_tools_from_config(str(path))
    return tool


def _call(tool, parameters):
    async def run():
        instance, _ = await tool.create()
        try:
            return await tool.execute(instance, parameters)
        finally:
            await tool.release(instance)

    return asyncio.run(run())


def test_the_local_index_answers_the_tool_call(tmp_path):
    corpus = write_corpus(DOCS, tmp_path / "corpus.jsonl")
    tool = _tools(tmp_path, {"corpus_path": str(corpus), "topk": 1})
    assert tool.name == "search"
    response, reward, metrics = _call(tool, {"query": "mop"})
    assert (
        response.text == "Doc 1(Title: Mop) The code of the mop is 12.\n" and reward == 0.0 and metrics == {"valid": 1}
    )
    response, _, metrics = _call(tool, {"query": ["zib", "code"]})  # Search-R1 allows a list
    assert response.text.startswith("Doc 1(Title: Zib)")
    response, _, metrics = _call(tool, {"query": "  "})
    assert "non-empty" in response.text and metrics == {"valid": 0}


def test_the_retrieval_server_answers_the_tool_call(tmp_path):
    httpd = srv.serve(BM25Index(DOCS), "127.0.0.1", 0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        tool = _tools(tmp_path, {"retrieval_service_url": f"http://127.0.0.1:{httpd.server_port}/retrieve", "topk": 2})
        response, _, _ = _call(tool, {"query": "zib"})
        assert response.text.splitlines() == [
            "Doc 1(Title: Zib) The code of the zib is 47.",
            "Doc 2(Title: Mop) The code of the mop is 12.",
        ]
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def test_a_tool_config_needs_exactly_one_source(tmp_path):
    with pytest.raises(ValueError, match="exactly one of config.corpus_path"):
        _tools(tmp_path, {})
    with pytest.raises(ValueError, match="exactly one of config.corpus_path"):
        _tools(tmp_path, {"corpus_path": "c.jsonl", "retrieval_service_url": "http://x"})
