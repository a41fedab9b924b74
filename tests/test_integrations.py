"""Every recipe in integrations/ runs end to end through Pyserini's own CLIs on a small SciFact subset.

The recipes run under bash with ``PYTHON`` naming a recorder, and the Python commands they issue then run in this
process, in order, through the same start-up hook (a real child process of each of those CLIs, the hybrid one
included: tests/test_readme.py, tests/test_cli.py, tests/test_distributed.py).
"""
import os
import sys
from pathlib import Path

import pytest

from pyserini_aligner.bm25 import bm25_search, build_lucene_index
from pyserini_aligner.data import Dataset, write_json_collection
from pyserini_aligner.metrics import FILE_DOCID_WIDTHS
from pyserini_aligner.trec import read_run, write_run

from conftest import run_module
from recorder import record, replay, write_recorder

RECIPES = Path(__file__).resolve().parents[1] / "integrations"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from conftest import make_beir_folder

    root = tmp_path_factory.mktemp("integrations")
    dataset = Dataset(str(make_beir_folder(root / "beir", n_docs=60, words=32)))
    write_json_collection(dataset.docs(), root / "collection")
    queries = dataset.queries()
    topics = root / "topics.tsv"
    topics.write_text("".join(f"{qid}\t{text}\n" for qid, text in queries.items()))
    build_lucene_index(dataset.docs(), root / "lucene")
    out = root / "out"
    out.mkdir()
    write_run(bm25_search(root / "lucene", queries), out / "run.bm25.trec", tag="bm25")
    recorder = write_recorder(root / "bin")
    env = dict(os.environ, PYTHON=sys.executable, CORPUS=str(root / "collection"), INDEX=str(root / "index"),
               LUCENE_INDEX=str(root / "lucene"), TOPICS=str(topics), OUT=str(out),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.pop("OPENAI_API_KEY", None)
    recipe_in_process(env, recorder, "build_index.sh")
    return env, queries, out, recorder


@pytest.fixture(scope="module")
def faiss_run(setup) -> Path:
    env, _, out, recorder = setup
    recipe_in_process(env, recorder, "faiss_search.sh")
    return out / "run.aligner.trec"


def recipe_in_process(env: dict, recorder: Path, name: str) -> None:
    """Run recipe ``name`` with ``$PYTHON`` the recorder, then each recorded command in this process; each must
    exit 0."""
    commands = record(["bash", str(RECIPES / name)], recorder, recorder.parent / f"{name}.commands", env)
    assert commands, f"{name} ran no Python command"
    for command in commands:
        replay(command, name)


def check_run(path: Path, queries: dict, remove_query: bool = False) -> dict:
    run = read_run(path)
    assert set(run) == set(queries)
    assert all(len(hits) >= 10 for hits in run.values())
    if remove_query:
        assert all(qid not in hits for qid, hits in run.items())
    return run


def test_faiss_cli_with_aligner_encoder(setup, faiss_run):
    check_run(faiss_run, setup[1], remove_query=True)


def test_faiss_cli_with_the_other_shipped_checkpoint(setup, faiss_run):
    """``--encoder aligner-mix`` (a shipped name containing "aligner") indexes and searches through Pyserini's CLI."""
    from pyserini_aligner.index.format import read_manifest

    env, queries, out, _ = setup
    index = Path(env["INDEX"]).parent / "index-mix"
    assert run_module("pyserini_aligner.index", "--corpus", env["CORPUS"], "--index", index,
                      "--encoder", "aligner-mix", "--quiet") == 0
    assert read_manifest(index).model_name == "aligner-mix"
    assert run_module("pyserini.search.faiss", "--index", index, "--encoder", "aligner-mix", "--topics",
                      env["TOPICS"], "--output", out / "run.mix.trec", "--hits", "100", "--remove-query") == 0
    mix, default = check_run(out / "run.mix.trec", queries, remove_query=True), read_run(faiss_run)
    assert any(mix[qid] != default[qid] for qid in queries)  # another model's scores


def test_lucene_habit_is_forwarded_to_aligner(setup, faiss_run):
    env, queries, out, recorder = setup
    recipe_in_process(env, recorder, "lucene_habit.sh")  # pyserini.search here; pyserini.search.lucene a child
    habit, faiss_run = read_run(out / "run.habit.trec"), read_run(faiss_run)
    check_run(out / "run.habit.trec", queries)
    for qid in queries:  # same searcher, same scores
        top = sorted(faiss_run[qid], key=faiss_run[qid].get, reverse=True)[:10]
        assert sorted(habit[qid], key=habit[qid].get, reverse=True)[:10] == top


def test_hybrid_cli(setup):
    env, queries, out, recorder = setup
    recipe_in_process(env, recorder, "hybrid_search.sh")  # as a child process: tests/test_readme.py
    check_run(out / "run.hybrid.trec", queries)


def test_plugin_cli_with_knobs(setup):
    env, queries, out, recorder = setup
    recipe_in_process(env, recorder, "aligner_search.sh")
    check_run(out / "run.aligner-top2.trec", queries, remove_query=True)


def test_fusion_pyserini_and_ranx(setup, faiss_run):
    env, queries, out, recorder = setup
    for name in ("run.aligner.trec", "run.bm25.trec"):  # ranx's file kernels for these widths: metrics.warm_up
        assert max(len(docid) for hits in read_run(out / name).values() for docid in hits) in FILE_DOCID_WIDTHS
    recipe_in_process(env, recorder, "fusion.sh")
    for name in ("run.pyserini-rrf.trec", "run.ranx-rrf.trec"):
        fused = read_run(out / name)
        assert set(fused) == set(queries)
