"""What pyserini-aligner changes in Pyserini's own modules, applied by the start-up import hook
(:mod:`pyserini_aligner._startup`) when Pyserini imports them: :mod:`.hooks` (command lines, encoders,
searchers, the JVM), :mod:`.server` (the REST and MCP servers), :mod:`.help_cache` (``--help`` of the FAISS and
hybrid command lines). Kept free of imports: the hook reads :data:`HOOKED` at interpreter start-up. Patches, by
module name:

- ``jnius`` (before it starts the JVM): pick a Java >= 21 and drop JVM options the runtime lacks;
- ``pyserini.encode._openai``: let it import when ``OPENAI_API_KEY`` is unset;
- ``pyserini.encode``: in a command line of Pyserini or of the plugin, Pyserini's encoder modules are imported when
  first used (:mod:`.deferred`); after it, register the ``aligner`` encoders in Pyserini's encoder maps;
- ``pyserini.search`` (before), run by ``python -m pyserini.search.faiss`` or ``hybrid`` with ``--help``: the help
  saved by an earlier ``--help`` is printed before Pyserini loads (:mod:`.help_cache`);
- ``pyserini.search.faiss._searcher`` (after): ``FaissSearcher(<aligner index>, ...)`` gives an ``AlignerSearcher``;
- ``pyserini.search.lucene.__main__`` (run by ``python -m``): an AligneR ``--index`` is searched with AligneR, the
  Lucene-only flags (``hooks.LUCENE_ONLY_FLAGS``) dropped with a warning;
- ``pyserini.search.__main__``: forwarded to ``pyserini.search.lucene`` with this interpreter, exit status kept;
- ``pyserini.search.faiss.__main__``, ``pyserini.search.hybrid.__main__``: with an AligneR index or encoder (``aligner``
  or a checkpoint folder, told by its config.json), errors give one line and a non-zero exit and the run file appears
  only when complete; ``--filter``/``--filter-field`` restrict both sides of a search (:mod:`.filtered`); with
  ``--help``, Pyserini's help ends with notes on the ``aligner`` encoder and the filter flags;
- ``pyserini.encode.__main__`` with an AligneR encoder: refused, naming the command that builds an AligneR index;
- ``pyserini.server.models``, ``.search_controller``, ``.rest.routes.indexes``, ``.rest.app``: Pyserini's REST and MCP
  servers serve AligneR indexes; ``pyserini.encode.optional._uniir`` imports without its optional package (M-BEIR
  encoders) so that they start (:mod:`.server`).
"""

HOOKED = frozenset({  # the modules whose loading the start-up hook wraps
    "jnius",
    "pyserini.encode",
    "pyserini.encode._openai",
    "pyserini.encode.__main__",
    "pyserini.search",
    "pyserini.search.faiss._searcher",
    "pyserini.search.lucene.__main__",
    "pyserini.search.__main__",
    "pyserini.search.faiss.__main__",
    "pyserini.search.hybrid.__main__",
    "pyserini.encode.optional._uniir",
    "pyserini.server.models",
    "pyserini.server.search_controller",
    "pyserini.server.rest.routes.indexes",
    "pyserini.server.rest.app",
})
