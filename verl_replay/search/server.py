"""A Search-R1-style retrieval server over a local corpus: ``POST /retrieve``.

    python -m verl_replay.search.server --corpus wiki-18.jsonl --port 8000 [--topk 3]

Request and response are Search-R1's (``search_r1/search/retrieval_server.py``), so the same
client works against either server::

    {"queries": ["..."], "topk": 3, "return_scores": true}
    -> {"result": [[{"document": {"id": ..., "contents": "title\\ntext"}, "score": 12.3}, ...]]}

BM25 (``bm25s``) over the whole corpus in memory; one process serves every rollout worker of a
run (point ``LocalSearchTool``'s ``retrieval_service_url`` at it). Standard library HTTP, one
thread per request; the index is read-only after start-up.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from verl_replay.search.index import BM25Index

MAX_QUERIES = 4096


def retrieve_payload(index: BM25Index, request: Any, default_topk: int) -> dict[str, Any]:
    """The response body for one ``/retrieve`` request body (raises ValueError on a bad one)."""
    if not isinstance(request, dict) or not isinstance(request.get("queries"), list):
        raise ValueError("the body must be a JSON object with a 'queries' list")
    queries = [str(q) for q in request["queries"]]
    if len(queries) > MAX_QUERIES:
        raise ValueError(f"at most {MAX_QUERIES} queries per request, got {len(queries)}")
    topk = int(request.get("topk") or default_topk)
    with_scores = bool(request.get("return_scores", False))
    result = []
    for hits in index.search(queries, topk) if queries else []:
        docs = [{"id": doc.doc_id, "contents": doc.contents} for doc, _ in hits]
        result.append(
            [{"document": d, "score": s} for d, (_, s) in zip(docs, hits, strict=True)] if with_scores else docs
        )
    return {"result": result}


def make_handler(index: BM25Index, default_topk: int) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") != "/retrieve":
                self._send(404, {"error": f"unknown path {self.path}; POST /retrieve"})
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                self._send(200, retrieve_payload(index, body, default_topk))
            except (ValueError, TypeError) as exc:
                self._send(400, {"error": str(exc)})

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise
            return

    return Handler


def serve(index: BM25Index, host: str, port: int, default_topk: int = 3) -> ThreadingHTTPServer:
    """A started-but-not-serving server (call ``serve_forever``); port 0 picks a free port."""
    return ThreadingHTTPServer((host, port), make_handler(index, default_topk))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_replay.search.server", description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", required=True, help="JSON-lines corpus ({'id', 'contents'} per line)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--topk", type=int, default=3, help="documents per query when a request names none")
    args = parser.parse_args(argv)
    try:
        index = BM25Index.from_file(args.corpus)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: --corpus: {exc}", file=sys.stderr)
        return 2
    server = serve(index, args.host, args.port, args.topk)
    print(f"retrieval server: {len(index.docs)} documents, POST http://{args.host}:{server.server_port}/retrieve")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
