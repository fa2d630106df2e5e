"""BM25 retrieval over a local corpus (``bm25s``), with Search-R1's corpus and result formats.

Corpus file: JSON lines, one document per line, ``{"id": ..., "contents": "Title\\ntext"}`` (the
format of Search-R1's ``wiki-18.jsonl``; a ``title`` + ``text`` pair is accepted too). Results
are formatted as Search-R1's retriever formats them for the model::

    Doc 1(Title: <title>) <text>
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# verl's tool config entry for the search tool (verl_replay.integrations.verl.search_tool).
SEARCH_TOOL_CLASS = "verl_replay.integrations.verl.search_tool.LocalSearchTool"
SEARCH_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches the knowledge corpus for documents relevant to a query.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "The search query."}},
            "required": ["query"],
        },
    },
}


@dataclass(frozen=True)
class Document:
    doc_id: str
    contents: str  # "title\ntext", as in Search-R1's corpus

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0]

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) > 1 else ""


def _document(record: Any, where: str) -> Document:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a corpus line must be a JSON object with 'contents' (or 'title' and 'text')")
    if "contents" in record:
        contents = str(record["contents"])
    elif "text" in record:
        contents = f"{record.get('title', '')}\n{record['text']}"
    else:
        raise ValueError(f"{where}: a corpus line needs 'contents' (or 'title' and 'text')")
    return Document(doc_id=str(record.get("id", record.get("doc_id", ""))), contents=contents)


def read_corpus(path: str | os.PathLike[str]) -> list[Document]:
    """The documents of a JSON-lines corpus file, in file order."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such corpus file (JSON lines with 'contents')")
    docs = []
    with open(p, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{p}:{lineno}: not JSON: {exc}") from exc
                docs.append(_document(record, f"{p}:{lineno}"))
    if not docs:
        raise ValueError(f"{p}: the corpus has no documents")
    return docs


def write_corpus(docs: Sequence[Document], path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps({"id": doc.doc_id, "contents": doc.contents}, ensure_ascii=False) + "\n")
    return p


def format_results(docs: Sequence[Document]) -> str:
    """Search-R1's ``_passages2string``: one ``Doc i(Title: ...) text`` line per hit."""
    return "".join(f"Doc {i}(Title: {doc.title}) {doc.text}\n" for i, doc in enumerate(docs, start=1))


class BM25Index:
    """A ``bm25s`` index over the corpus's documents (title and text both indexed)."""

    def __init__(self, docs: Sequence[Document]):
        import bm25s

        if not docs:
            raise ValueError("BM25Index needs at least one document")
        self.docs = list(docs)
        self._retriever = bm25s.BM25()
        self._retriever.index(
            bm25s.tokenize([d.contents for d in self.docs], stopwords="en", show_progress=False), show_progress=False
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> BM25Index:
        return cls(read_corpus(path))

    def search(self, queries: Sequence[str], topk: int = 3) -> list[list[tuple[Document, float]]]:
        """The ``topk`` best documents of each query with their BM25 scores, best first. A query
        with no indexed term scores every document 0 and gets the corpus's first ``topk``."""
        import bm25s

        k = max(1, min(int(topk), len(self.docs)))
        tokens = bm25s.tokenize([q if q.strip() else "_" for q in queries], stopwords="en", show_progress=False)
        ids, scores = self._retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [
            [(self.docs[int(i)], float(s)) for i, s in zip(row_ids, row_scores, strict=True)]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]
