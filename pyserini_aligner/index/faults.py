"""Named crash points for fault-injection tests of index writes.

With ``PYSERINI_ALIGNER_FAULT=<name>`` (or ``<name>:<n>``) in the environment, the process kills itself with SIGKILL
the first (n-th) time a write reaches point ``<name>``: the test suite uses it to prove that a write killed at any
step leaves the previous state intact. Without the variable a point costs one dictionary look-up.
"""
from __future__ import annotations

import os
import signal

ENV = "PYSERINI_ALIGNER_FAULT"
_seen: dict[str, int] = {}


def point(name: str) -> None:
    """Die here (SIGKILL) if ``$PYSERINI_ALIGNER_FAULT`` names this point."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, count = spec.partition(":")
    if target != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] >= int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
