"""``LocalSearchTool``: a verl tool (``verl.tools.base_tool.BaseTool``) that the tool agent loop
(``agent_name: tool_agent``) calls for retrieval.

Tool config (``actor_rollout_ref.rollout.multi_turn.tool_config_path``)::

    tools:
      - class_name: verl_replay.integrations.verl.search_tool.LocalSearchTool
        config: {type: native, corpus_path: /data/corpus.jsonl, topk: 3}
        # or, at paper scale, a server started with `python -m verl_replay.search.server`:
        # config: {type: native, retrieval_service_url: http://127.0.0.1:8000/retrieve, topk: 3}
        tool_schema: {type: function, function: {name: search, ...}}   # SEARCH_TOOL_SCHEMA

With ``corpus_path`` every rollout worker holds its own BM25 index (fine for small corpora);
with ``retrieval_service_url`` one server holds it. Either way the model sees Search-R1's
``Doc i(Title: ...) text`` lines.
"""

from __future__ import annotations

import functools
import json
import urllib.request
from typing import Any, Optional

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from verl_replay.search.index import SEARCH_TOOL_SCHEMA, BM25Index, Document, format_results

REQUEST_TIMEOUT_S = 30.0


@functools.lru_cache(maxsize=4)
def _index(corpus_path: str) -> BM25Index:
    return BM25Index.from_file(corpus_path)


def _remote_search(url: str, query: str, topk: int) -> list[Document]:
    body = json.dumps({"queries": [query], "topk": topk, "return_scores": False}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        payload = json.loads(response.read())
    hits = payload["result"][0]
    return [Document(str(h.get("id", "")), str(h["contents"])) for h in (x.get("document", x) for x in hits)]


class LocalSearchTool(BaseTool):
    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema]):
        if tool_schema is None:
            tool_schema = OpenAIFunctionToolSchema.model_validate(SEARCH_TOOL_SCHEMA)
        super().__init__(config, tool_schema)
        self.topk = int(config.get("topk", 3))
        self.corpus_path = config.get("corpus_path")
        self.url = config.get("retrieval_service_url")
        if bool(self.corpus_path) == bool(self.url):
            raise ValueError(
                "LocalSearchTool: set exactly one of config.corpus_path (a local BM25 index) and "
                "config.retrieval_service_url (a `python -m verl_replay.search.server`)"
            )

    def search(self, query: str) -> str:
        if self.url:
            docs = _remote_search(self.url, query, self.topk)
        else:
            docs = [doc for doc, _ in _index(str(self.corpus_path)).search([query], self.topk)[0]]
        return format_results(docs)

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        query = parameters.get("query")
        if isinstance(query, list):  # Search-R1's schema allows a list of queries
            query = " ".join(str(q) for q in query)
        if not isinstance(query, str) or not query.strip():
            return ToolResponse(text="Error: 'query' must be a non-empty string."), 0.0, {"valid": 0}
        return ToolResponse(text=self.search(query)), 0.0, {"valid": 1}
