"""Serve AligneR indexes from Pyserini's own REST (``python -m pyserini.server.rest``) and MCP
(``python -m pyserini.server.mcp``) servers.

The start-up hook lets Pyserini's ``SearchController`` serve AligneR indexes registered by name (``--index
NAME=PATH`` of ``python -m pyserini_aligner.serve`` or ``PYSERINI_ALIGNER_INDEXES``) or named by their folder, a
BM25 Lucene index registered with one (``NAME.bm25``) and their hybrid (``NAME.hybrid``). Concurrent searches of one
index are gathered into batches (:mod:`.batching`), an index updated on disk is picked up without a restart, and bad
requests get a 4xx with a one-line message. See docs/serving.md.
"""
