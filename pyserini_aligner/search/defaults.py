"""Search defaults shared by the searcher and the command lines (importing this loads nothing else)."""

DEFAULT_QUERY_PRUNE = 0.5  # β^q: the fraction of a query's tokens that probe the index
