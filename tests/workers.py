"""Test set-up shared by the workers of one test run (``pytest -n 2``, pytest-xdist): each worker has its own
temporary folder; what is built once for the whole run goes in the folder above them, under a lock."""
import contextlib
import fcntl
import os
from pathlib import Path


def shared_base(tmp_path_factory) -> Path:
    """The temporary folder every worker of this run sees (the session's own one without workers)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def built_once(tmp_path_factory, name: str):
    """The path ``name`` in :func:`shared_base`, held under a lock: the first worker builds it, the others wait
    and reuse it."""
    base = shared_base(tmp_path_factory)
    with open(base / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield base / name
