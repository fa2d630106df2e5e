"""Local retrieval for the agentic-search domain: a BM25 index over a document corpus
(``index.py``, built with ``bm25s``) and a Search-R1-style retrieval server (``server.py``,
``python -m verl_replay.search.server``) for paper-scale corpora. verl's tool agent loop calls
either through ``verl_replay.integrations.verl.search_tool.LocalSearchTool``."""
