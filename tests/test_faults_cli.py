"""Fault probes through the command lines, each a real child process of the CLI a user runs: Pyserini's CLIs with
AligneR in the path (misspelt indexes, unknown encoders, an AligneR index in the wrong slot, Ctrl-C, a bad JVM
setting, pyserini.encode), the plugin's own CLIs (bad devices, strategies, lengths and flag pairs, unwritable
outputs) and torchrun ranks that die at start-up. Each gives one line, the right exit status (2: usage, 1: run
time, 130: Ctrl-C) and leaves no stale or partial file.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pyserini_aligner.checkpoints import SHIPPED
from pyserini_aligner.trec import read_run

from conftest import messages, one_line_error, run, run_module, scifact_docs, stale_run

REPO = Path(__file__).resolve().parents[1]
QUERIES = {"q1": "vitamin D deficiency and bone density", "q2": "stem cells in the bone marrow",
           "q3": "antibiotic resistance of bacteria"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("faults_cli") / "corpus.jsonl"
    path.write_text("".join(json.dumps(doc) + "\n" for doc in scifact_docs(20, 48)))
    return path


@pytest.fixture(scope="module")
def index(corpus) -> Path:
    from pyserini_aligner.index.__main__ import main

    target = corpus.parent / "idx"
    assert main(["--corpus", str(corpus), "--index", str(target), "--quiet"]) == 0
    return target


@pytest.fixture(scope="module")
def topics(corpus) -> Path:
    path = corpus.parent / "topics.tsv"
    path.write_text("".join(f"{qid}\t{text}\n" for qid, text in QUERIES.items()))
    return path


# 3. Pyserini's CLIs with a misspelt index folder: exit status 2, no stale run (was: exit 0, the old run kept)


@pytest.mark.parametrize("cli", ["faiss", "hybrid"])
def test_misspelt_index_through_pyserini_fails_without_stale_run(index, topics, tmp_path, cli):
    output, missing = stale_run(tmp_path), index.parent / "idz"
    if cli == "faiss":
        args = ["--index", missing, "--encoder", "aligner", "--topics", topics, "--output", output]
    else:
        args = ["dense", "--index", missing, "--encoder", "aligner", "sparse", "--index", "lucene-idx", "fusion",
                "--alpha", "0.1", "run", "--topics", topics, "--output", output]
    result = run("-m", f"pyserini.search.{cli}", *args)
    one_line_error(result, 2, f"--index {missing}: no such folder")
    assert "Unrecognized index name" not in result.stdout  # refused before Pyserini looks for a prebuilt index
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the earlier run removed, nothing else written


# 7. user errors: one line and the exit status, never a traceback


# both command lines check --device with one argparse type (pyserini_aligner.cli.device): each reason once, each
# command line once
@pytest.mark.parametrize("cli, device", [("search", "cuda"), ("index", "banana")])
def test_bad_device_is_an_argparse_error(index, corpus, topics, tmp_path, cli, device):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this torch can use CUDA")
    if cli == "search":
        result = run("-m", "pyserini_aligner.search", "--index", index, "--topics", topics, "--output",
                     tmp_path / "run.trec", "--device", device)
    else:
        result = run("-m", "pyserini_aligner.index", "--corpus", corpus, "--index", tmp_path / "idx", "--device",
                     device)
    reason = "this torch is built without CUDA" if device == "cuda" else "expected cpu or cuda[:N], got 'banana'"
    one_line_error(result, 2, f"argument --device: {reason}" if device == "banana" else reason)
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_during_a_pyserini_faiss_search(index, tmp_path):
    """The JVM no longer takes SIGINT (it called exit() from a Java thread while torch ran in the main thread: a
    torch traceback "RuntimeError: unknown parameter type", or an abort)."""
    many = tmp_path / "many.tsv"
    many.write_text("".join(f"{qid}-{i}\t{text}\n" for i in range(1500) for qid, text in QUERIES.items()))
    out = tmp_path / "out"
    out.mkdir()
    err_path = tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        child = subprocess.Popen([sys.executable, "-m", "pyserini.search.faiss", "--index", str(index), "--encoder",
                                  "aligner", "--topics", str(many), "--output", str(out / "run.trec"),
                                  "--batch-size", "4"], cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                 stdout=subprocess.PIPE, stderr=err, text=True,
                                 # as from a terminal (a background job of a script inherits SIGINT ignored)
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            for line in child.stdout:  # Pyserini prints this line just before its search loop
                if line.startswith("Running"):
                    break
            time.sleep(2)  # in the middle of encoding and searching queries
            assert child.poll() is None, "the search ended before it could be interrupted"
            child.send_signal(signal.SIGINT)
            child.communicate(timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
    stderr = err_path.read_text()
    assert child.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert messages(stderr)[-1:] == ["interrupted"]
    assert list(out.iterdir()) == []  # neither a run nor its temporary file


def test_aligner_index_as_the_sparse_index_of_hybrid(index, topics, tmp_path):
    output = stale_run(tmp_path)
    result = run("-m", "pyserini.search.hybrid", "dense", "--index", index, "--encoder", "aligner", "sparse",
                 "--index", index, "fusion", "--alpha", "0.1", "run", "--topics", topics, "--output", output)
    one_line_error(result, 2, f"sparse --index {index} is an AligneR index; give it as the dense index")
    assert "IndexNotFoundException" not in result.stderr and list(tmp_path.iterdir()) == []


def test_bad_jvm_heap_setting_is_one_line(index, topics, tmp_path):
    result = run("-m", "pyserini.search.faiss", "--index", index, "--encoder", "aligner", "--topics", topics,
                 "--output", tmp_path / "run.trec", env={"PYSERINI_ALIGNER_JVM_HEAP": "abc"})
    one_line_error(result, 2, "PYSERINI_ALIGNER_JVM_HEAP='abc': expected a heap size such as 512m or 8g")
    assert list(tmp_path.iterdir()) == []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# rank 1: joins the process group, then is killed before the first exchange
DIES_AT_START_UP = ("import os, signal, torch.distributed as dist; dist.init_process_group('gloo'); "
                    "os.kill(os.getpid(), signal.SIGKILL)")


@pytest.mark.parametrize("cli", ["index", "search"])
def test_a_rank_killed_at_start_up(index, corpus, topics, tmp_path, cli):
    port = free_port()
    env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG", "TMPDIR", "IR_DATASETS_HOME",
                                                "PYSERINI_ALIGNER_BEIR_DIR") if name in os.environ}
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    if cli == "index":
        args = ["pyserini_aligner.index", "--corpus", str(corpus), "--index", str(tmp_path / "idx"), "--quiet",
                "--dist-timeout", "60"]
    else:
        args = ["pyserini_aligner.search", "--distributed", "--index", str(index), "--topics", str(topics),
                "--output", str(stale_run(tmp_path)), "--quiet"]
    ranks = [subprocess.Popen([sys.executable, "-m", *args], env={**env, "RANK": "0", "LOCAL_RANK": "0"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
             subprocess.Popen([sys.executable, "-c", DIES_AT_START_UP], env={**env, "RANK": "1", "LOCAL_RANK": "1"})]
    try:
        _, err = ranks[0].communicate(timeout=180)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.communicate()
    assert ranks[1].returncode == -9
    result = subprocess.CompletedProcess(args, ranks[0].returncode, "", err)
    one_line_error(result, 1, "rank 0")
    assert "[rank0]" not in err and "pair.cc" not in err
    assert list(tmp_path.iterdir()) == []  # no index, no build folder, no stale run


# 8. errors come before the work, and say what is wrong


def test_unknown_encoder_is_refused_at_once(index, topics, tmp_path):
    """Not a shipped name, a folder or a cached Hugging Face model: refused before Pyserini asks the hub for it."""
    result = run("-m", "pyserini.search.faiss", "--index", index, "--encoder", "nosuch", "--topics", topics,
                 "--output", tmp_path / "run.trec", env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    one_line_error(result, 2, f"--encoder nosuch: not a shipped AligneR checkpoint ({', '.join(SHIPPED)})")
    assert "huggingface.co" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_max_length_beyond_the_model_is_refused_before_encoding(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "short", "contents": "cold exposure"}) + "\n" +
                      json.dumps({"id": "long", "contents": " ".join(["adipose tissue"] * 400)}) + "\n")
    result = run("-m", "pyserini_aligner.index", "--corpus", corpus, "--index", tmp_path / "idx", "--max-length",
                 "600", "--quiet")
    one_line_error(result, 1, "max_length 600 exceeds the 512 token positions of the model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]


def test_output_that_cannot_be_created_fails_in_the_early_check(index, topics):
    """As root, os.access calls /proc writable: a file is created and removed there to be sure."""
    started = time.perf_counter()
    result = run("-m", "pyserini_aligner.search", "--index", index, "--topics", topics, "--output",
                 "/proc/run.trec", "--quiet")
    one_line_error(result, 2, "output /proc/run.trec: can't create a file in its folder /proc")
    assert time.perf_counter() - started < 60  # no model was loaded, no query ran


def test_more_shards_than_documents_is_named(corpus, tmp_path):
    result = run("-m", "pyserini_aligner.index", "--corpus", corpus, "--index", tmp_path / "idx", "--shard-id", "0",
                 "--shard-num", "50", "--quiet")
    one_line_error(result, 1, "--shard-num 50 is larger than the corpus (20 documents)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cli", ["search", "explain"])
def test_bad_strategy_is_an_argparse_error(index, topics, tmp_path, cli):
    args = ["--topics", topics, "--output", tmp_path / "run.trec"] if cli == "search" else ["--query", "cells"]
    result = run("-m", f"pyserini_aligner.{cli}", "--index", index, *args, "--strategy", "top-q:1")
    one_line_error(result, 2, "argument --strategy: bad alignment strategy 'top-q:1'")
    assert list(tmp_path.iterdir()) == []


# 9. flags that did nothing


def test_pyserini_max_length_sets_the_query_length(index, topics, tmp_path):
    """The command line runs in this process (python -m)."""
    from pyserini_aligner.search.searcher import AlignerSearcher

    assert run_module("pyserini.search.faiss", "--index", index, "--encoder", "aligner", "--topics", topics,
                      "--output", tmp_path / "run.trec", "--hits", "5", "--max-length", "4") == 0
    got = read_run(tmp_path / "run.trec")
    texts = list(QUERIES.values())
    cut, full = AlignerSearcher(index, query_max_length=4).rank(texts, k=5), AlignerSearcher(index).rank(texts, k=5)
    assert cut != full  # four tokens a query change the rankings
    assert [sorted(got[qid], key=got[qid].get, reverse=True) for qid in QUERIES] == [[d for d, _ in h] for h in cut]


@pytest.mark.parametrize("flags,message", [
    (["--index", "idx", "--compact", "--retrain-codec", "--strict"], "--strict goes with --delete"),
    (["--index", "idx", "--delete", "ids.txt", "--retrain-codec"], "--retrain-codec goes with --compact"),
    (["--corpus", "corpus.jsonl", "--index", "idx", "--dist-timeout", "-5"],
     "argument --dist-timeout: expected a number > 0, got '-5'"),
], ids=["strict", "retrain-codec", "dist-timeout"])
def test_index_flags_that_would_do_nothing_are_errors(tmp_path, flags, message):
    result = run("-m", "pyserini_aligner.index", *flags)
    one_line_error(result, 2, message)


# 10. Pyserini's routes


def test_pyserini_encode_with_aligner_is_refused_and_writes_nothing(corpus, tmp_path):
    result = run("-m", "pyserini.encode", "input", "--corpus", corpus.parent, "--fields", "text", "output",
                 "--embeddings", tmp_path / "emb", "--to-faiss", "encoder", "--encoder", "aligner", "--device", "cpu")
    one_line_error(result, 2, f"build an AligneR index with python -m pyserini_aligner.index --corpus {corpus.parent} "
                              f"--index {tmp_path / 'emb'} --encoder aligner")
    assert list(tmp_path.iterdir()) == []


def test_pyserini_faiss_help_mentions_aligner():
    result = run("-m", "pyserini.search.faiss", "--help")
    assert result.returncode == 0 and "usage:" in result.stdout
    assert "--encoder aligner (or aligner-mix, or an AligneR checkpoint folder)" in " ".join(result.stdout.split())


def test_every_variable_a_recipe_reads_is_documented():
    recipes = REPO / "integrations"
    table = (recipes / "README.md").read_text()
    documented = set(re.findall(r"^\| `([A-Z0-9_]+)` \|", table, flags=re.M))
    for script in sorted(recipes.glob("*.sh")):
        used = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", script.read_text()))
        assert used <= documented, f"{script.name} reads {sorted(used - documented)}, not in integrations/README.md"
