"""Named crash points for fault-injection tests of index writes.

With ``PYSERINI_ALIGNER_FAULT=<name>`` (or ``<name>:<n>``, or ``<name>:<n>:<SIGNAL>``) in the environment, the
process sends itself SIGKILL (or ``SIGNAL``, e.g. SIGINT for a Ctrl-C) the first (n-th) time a write reaches point
``<name>``: the test suite uses it to prove that a write killed or interrupted at any step leaves the previous state
intact. Without the variable a point costs one dictionary look-up.
"""
from __future__ import annotations

import os
import signal

ENV = "PYSERINI_ALIGNER_FAULT"
_seen: dict[str, int] = {}


def point(name: str) -> None:
    """Die here (SIGKILL, or the signal the variable names) if ``$PYSERINI_ALIGNER_FAULT`` names this point."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, rest = spec.partition(":")
    if target != name:
        return
    count, _, sent = rest.partition(":")
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] >= int(count or 1):
        os.kill(os.getpid(), getattr(signal, sent) if sent else signal.SIGKILL)
