"""What a command line loads before its first query: ``--help`` of the plugin's search loads neither torch nor
Pyserini, a search from the plugin's CLI never starts the JVM nor loads ir_datasets or ranx, and the run writer
that makes this possible writes the lines of Pyserini's writers byte for byte. (Timings: ``python -m
eval.bench_startup``.)"""
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from pyserini_aligner.trec import write_run

from conftest import assert_same_run

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "quickstart"
Hit = namedtuple("Hit", "docid score")  # what Pyserini's writers read from a hit


def imported_modules(args: list[str], cwd: Path | None = None) -> set[str]:
    """Every module ``python -X importtime ARGS`` imports (the command must succeed)."""
    done = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


def roots(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


def test_search_help_loads_neither_torch_nor_pyserini():
    loaded = roots(imported_modules(["-m", "pyserini_aligner.search", "--help"]))
    assert "pyserini_aligner" in loaded
    assert not loaded & {"torch", "pyserini", "jnius", "transformers", "faiss", "ir_datasets", "ranx", "numba"}


def test_a_search_from_the_plugin_cli_starts_no_jvm(tmp_path, model):
    from pyserini_aligner.index import build_index, read_json_collection

    index = tmp_path / "idx"
    build_index(read_json_collection(QUICKSTART / "corpus"), index, model, progress=False, model_name="aligner")
    topics = tmp_path / "topics.tsv"
    topics.write_text("".join((QUICKSTART / "topics.tsv").read_text().splitlines(keepends=True)[:5]))
    modules = imported_modules(["-m", "pyserini_aligner.search", "--index", str(index), "--topics", str(topics),
                                "--output", str(tmp_path / "run.trec"), "--hits", "10", "--quiet"])
    assert "torch._dynamo" not in modules  # (seconds of import: building modules on the meta device loads it)
    loaded = roots(modules)
    assert {"torch", "faiss"} <= loaded  # the search ran
    assert not loaded & {"pyserini", "jnius", "ir_datasets", "ranx", "numba", "transformers"}
    assert len((tmp_path / "run.trec").read_text().splitlines()) == 50
    # Pyserini's own command line, on the same index: its other encoders (transformers' models, scikit-learn, the
    # OpenAI client) are not imported, and the run is the plugin's, line for line.
    loaded = roots(imported_modules(["-m", "pyserini.search.faiss", "--index", str(index), "--topics", str(topics),
                                     "--output", str(tmp_path / "faiss.trec"), "--hits", "10", "--encoder",
                                     "aligner"]))
    assert {"pyserini", "jnius", "torch", "faiss"} <= loaded
    assert not loaded & {"transformers", "sklearn", "openai"}
    theirs, ours = ([line.split() for line in (tmp_path / name).read_text().splitlines()]
                    for name in ("faiss.trec", "run.trec"))
    assert [line[:4] + line[5:] for line in theirs] == [line[:4] + ["Faiss"] for line in ours]
    assert_same_run(tmp_path / "faiss.trec", tmp_path / "run.trec")  # scores of two processes: to rounding


def test_pyserinis_bm25_command_line_imports_no_encoder_it_does_not_use(tmp_path, fielded_lucene):
    """Pyserini's own BM25 search from its command line imports Pyserini's encoder base classes only (none of its
    encoder modules, transformers' model classes nor the OpenAI client) and writes the run LuceneSearcher gives."""
    from pyserini.search.lucene import LuceneSearcher

    topics = tmp_path / "topics.tsv"
    topics.write_text("".join(QUICKSTART.joinpath("topics.tsv").read_text().splitlines(keepends=True)[:3]))
    output = tmp_path / "bm25.trec"
    loaded = imported_modules(["-m", "pyserini.search.lucene", "--index", str(fielded_lucene), "--topics",
                               str(topics), "--output", str(output), "--hits", "5", "--bm25"])
    assert "pyserini.encode" in loaded and "pyserini.encode._base" in loaded
    assert not {m for m in loaded if m.startswith("pyserini.encode._") and m != "pyserini.encode._base"}
    assert not roots(loaded) & {"openai", "ir_datasets", "ranx"}
    assert "transformers.models.bert.modeling_bert" not in loaded
    searcher = LuceneSearcher(str(fielded_lucene))
    want = [(qid, hit.docid, str(rank), hit.score)
            for qid, text in (line.split("\t", 1) for line in topics.read_text().splitlines())
            for rank, hit in enumerate(searcher.search(text, k=5), start=1)]
    got = [line.split() for line in output.read_text().splitlines()]
    assert [(qid, docid, rank) for qid, _, docid, rank, _, _ in got] == [w[:3] for w in want]
    assert [float(row[4]) for row in got] == pytest.approx([w[3] for w in want], abs=1e-5)


@pytest.mark.parametrize("output_format, max_passage", [("trec", False), ("msmarco", False), ("trec", True),
                                                        ("msmarco", True)])
def test_run_lines_are_pyserini_writers_lines(tmp_path, output_format, max_passage):
    from pyserini.output_writer import OutputFormat, get_output_writer

    hits = {"q1": [("d1#0", 3.25), ("d1#1", 2.0), ("d2#0", 1.0 / 3), ("d3", -0.5), ("d2#5", -1e-7)],
            "q2": [("é#1", 1e6), ("x", 0.0)], "q3": []}
    ours = write_run(hits, tmp_path / "ours", tag="AligneR", output_format=output_format, max_passage=max_passage,
                     max_passage_hits=2)
    with get_output_writer(str(tmp_path / "theirs"), OutputFormat(output_format), "w", max_hits=sys.maxsize,
                           tag="AligneR", use_max_passage=max_passage, max_passage_delimiter="#",
                           max_passage_hits=2) as writer:
        for qid, ranked in hits.items():
            writer.write(qid, [Hit(docid, score) for docid, score in ranked])
    assert ours.read_bytes() == (tmp_path / "theirs").read_bytes() != b""


def test_pyserini_faiss_help_is_printed_before_pyserini_loads(tmp_path):
    """The first --help builds Pyserini's help (and saves it); the next one prints the same text, loading none of
    Pyserini's packages, torch or the JVM."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    args = [sys.executable, "-X", "importtime", "-m", "pyserini.search.faiss", "--index", str(tmp_path), "--help"]
    first = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    second = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == second.returncode == 0, first.stderr[-2000:] + second.stderr[-2000:]
    assert first.stdout.startswith("usage:")
    assert second.stdout == first.stdout
    loaded = {line.rsplit("|", 1)[1].strip() for line in second.stderr.splitlines()
              if line.startswith("import time:") and line.count("|") == 2}
    assert "pyserini" in loaded and not roots(loaded) & {"torch", "jnius", "faiss", "transformers"}
    assert not {"pyserini.search.faiss", "pyserini.search.lucene", "pyserini.encode"} & loaded


@pytest.mark.parametrize("argv, expected", [
    (["python", "-m", "pyserini_aligner.search", "--help"], "PASSIVE"),
    (["python", "-m", "pyserini_aligner.index"], "PASSIVE"),
    (["python", "-c", "pass"], None),
    (["python", "-m", "json.tool"], None),
    (["python", "script.py", "-m"], None),
])
def test_openmp_threads_sleep_on_the_plugin_command_lines(monkeypatch, argv, expected):
    from pyserini_aligner import _startup

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(sys, "orig_argv", argv)
    _startup.quiet_openmp()
    assert os.environ.get("OMP_WAIT_POLICY") == expected
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    _startup.quiet_openmp()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"  # a setting of the user's is kept


def test_a_deferred_class_imports_its_module_when_first_used():
    from pyserini_aligner.pyserini_patches.deferred import DeferredModule, resolve

    assert resolve("_auto", "pyserini.encode", 1) == "pyserini.encode._auto"
    assert resolve("", "pyserini.encode.optional", 2) == "pyserini.encode"
    assert resolve("json", None, 0) == "json"
    code = ("import sys\n"
            "from pyserini_aligner.pyserini_patches.deferred import DeferredModule\n"
            "Scheduler = DeferredModule('sched').scheduler\n"
            "assert not isinstance(1, Scheduler) and not issubclass(int, Scheduler)\n"
            "assert 'sched' not in sys.modules and 'not imported yet' in repr(Scheduler)\n"
            "made = Scheduler()\n"
            "import sched\n"
            "assert type(made) is sched.scheduler and isinstance(made, Scheduler)\n"
            "assert issubclass(sched.scheduler, Scheduler) and Scheduler.real() is sched.scheduler\n"
            "assert Scheduler.enter is sched.scheduler.enter\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with pytest.raises(AttributeError):
        DeferredModule("pyclbr").__wrapped__
