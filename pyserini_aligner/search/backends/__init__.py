"""Search backends: where an index's codes or vectors live, and how a batch of encoded queries is searched there
(:mod:`.base` says what they share; one module per family; :mod:`.choose` picks one, and its front end, when an index
generation is opened)."""
