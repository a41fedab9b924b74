"""The plugin's command lines follow Pyserini's: unknown flags are errors (Lucene-only flags dropped on purpose when
Pyserini's Lucene CLI forwards), run files come from Pyserini's writers (trec, msmarco, MaxP), defaults show in
--help, indexing shows a progress bar with a total, and Pyserini's CLIs know an AligneR checkpoint folder by its
config.json. Flag values are parsed by argparse types into what the library takes (a bad one names the flag), and
every command line runs through one runner: exit status 2 for a usage error, 1 for a run-time error (one line, no
traceback), 130 for Ctrl-C, and --quiet keeps warnings only."""
import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyserini_aligner import cli as shared
from pyserini_aligner.alignment import Strategy
from pyserini_aligner.index.codec_spec import AUTO_CODEC, CodecSpec
from pyserini_aligner.index.options import codec_arg

from pyserini_aligner.index import build_index
from pyserini_aligner.index import __main__ as index_cli
from pyserini_aligner.index.corpus import count_corpus
from pyserini_aligner.pyserini_patches.hooks import (LUCENE_ONLY_FLAGS, is_aligner_checkpoint, register_checkpoint_encoders,
                                                split_lucene_only)
from pyserini_aligner.search import __main__ as search_cli
from pyserini_aligner.search.searcher import AlignerSearcher
from pyserini_aligner.trec import read_run, write_run

from conftest import run_module

REPO = Path(__file__).resolve().parents[1]
CHECKPOINT = REPO / "pyserini_aligner" / "checkpoints" / "aligner"
QUERIES = {"q1": "vitamin D deficiency and bone density", "q2": "stem cells in the bone marrow",
           "q3": "antibiotic resistance of bacteria"}
CLI_MODULES = ["pyserini_aligner.search.__main__", "pyserini_aligner.index.__main__", "pyserini_aligner.index.merge",
               "pyserini_aligner.adapt.__main__", "pyserini_aligner.explain.__main__", "pyserini_aligner.train.__main__",
               "pyserini_aligner.train.prepare", "pyserini_aligner.checkpoints.make_default",
               "pyserini_aligner.serve.__main__"]


@pytest.fixture(scope="module")
def topics(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "topics.tsv"
    path.write_text("".join(f"{qid}\t{text}\n" for qid, text in QUERIES.items()))
    return path


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=300)


def flat(text: str) -> str:
    return " ".join(text.split())


# --help


@pytest.mark.parametrize("module", CLI_MODULES)
def test_help_shows_every_default(module):
    import importlib

    parser = importlib.import_module(module).build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert "default" in formatter._get_help_string(action), (module, action.option_strings)
    text = parser.format_help()  # renders, naming every flag that is not hidden
    assert all(flag in text for action in parser._actions if action.help is not argparse.SUPPRESS
               for flag in action.option_strings), module


def test_search_help_texts():
    text = flat(search_cli.build_parser().format_help())
    assert "hits per query (default: 1000)" in text
    assert "--output-format {trec,msmarco}" in text
    assert "BEIR's convention" in text and "don't use it where query ids and docids" in text
    assert "--query-max-length" in text
    assert "tokens per document (default: the model's doc_maxlen" in flat(index_cli.build_parser().format_help())


# unknown flags


@pytest.mark.parametrize("parser, argv", [(search_cli.build_parser, ["--topics", "t", "--output", "o"]),
                                          (index_cli.build_parser, ["--corpus", "c"])], ids=["search", "index"])
def test_unknown_flag_is_an_error(parser, argv, capsys):
    with pytest.raises(SystemExit) as stop:
        parser().parse_args(["--index", "i", *argv, "--bm25"])
    assert stop.value.code == 2
    assert "error: unrecognized arguments: --bm25\n" in capsys.readouterr().err


def test_split_lucene_only():
    argv = ["--index", "x", "--bm25", "--k1", "0.9", "--b=0.4", "--fields", "title=2", "body=1", "--hits", "3",
            "--rm3", "--remove-query"]
    kept, dropped = split_lucene_only(argv)
    assert kept == ["--index", "x", "--hits", "3", "--remove-query"]
    assert dropped == ["--bm25", "--k1", "0.9", "--b=0.4", "--fields", "title=2", "body=1", "--rm3"]
    assert not set(LUCENE_ONLY_FLAGS) & {a.option_strings[0] for a in search_cli.build_parser()._actions}


def test_lucene_cli_drops_lucene_only_flags_and_refuses_others(index_dir, topics, tmp_path, capsys):
    """In this process, through the start-up hook (a real ``python -m pyserini.search.lucene`` child: the next
    test and tests/test_integrations.py)."""
    output = tmp_path / "run.trec"
    common = ["--index", str(index_dir), "--topics", str(topics), "--output", str(output), "--hits", "3", "--quiet"]
    assert run_module("pyserini.search.lucene", *common, "--bm25", "--k1", "0.9", "--b", "0.4") == 0
    assert "ignoring Lucene-only flags for an AligneR index: --bm25 --k1 0.9 --b 0.4" in capsys.readouterr().err
    assert {qid: len(hits) for qid, hits in read_run(output).items()} == {qid: 3 for qid in QUERIES}
    assert run_module("pyserini.search.lucene", *common, "--bogus", "1") == 2
    assert "unrecognized arguments: --bogus 1" in capsys.readouterr().err
    assert not output.exists()  # a failed search leaves no run, not even the earlier one


def test_pyserini_search_forwards_with_this_interpreter(index_dir, topics, tmp_path):
    """No venv on PATH, and a ``python`` there that is not this one: the child must still be this interpreter, and
    its failure the parent's exit status, with no run left (a complete run's 0: tests/test_integrations.py)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("python", "python3"):
        (fake / name).write_text("#!/bin/sh\necho 'wrong python' >&2\nexit 97\n")
        (fake / name).chmod(0o755)
    venv_bin = os.path.dirname(sys.executable)
    path = os.pathsep.join([str(fake)] + [d for d in os.environ["PATH"].split(os.pathsep) if d != venv_bin])
    output = tmp_path / "run.trec"
    result = run("-m", "pyserini.search", "--index", str(index_dir), "--topics", str(topics), "--output", str(output),
                 "--hits", "0", env={"PATH": path})
    assert result.returncode == 2, result.stderr
    assert "argument --hits: expected an integer >= 1, got '0'" in result.stderr
    assert "wrong python" not in result.stderr
    assert not output.exists()


# run files


@pytest.fixture(scope="module")
def passage_index(tmp_path_factory, model) -> Path:
    """Six passages of three documents, docids ``<doc>#<passage>``."""
    texts = {"bone": ["vitamin D and calcium keep bone density", "bone loss in older adults",
                      "fractures follow low bone density"],
             "cells": ["stem cells live in the bone marrow", "marrow transplants restore blood cells"],
             "germs": ["bacteria resist antibiotics through efflux pumps"]}
    docs = [(f"{doc}#{i}", text) for doc, passages in texts.items() for i, text in enumerate(passages)]
    target = tmp_path_factory.mktemp("passages") / "index"
    build_index(docs, target, model, codec="fp16", doc_prune=1.0, progress=False, model_name="aligner")
    return target


def test_output_formats_and_max_passage(passage_index, topics, tmp_path):
    common = ["--index", str(passage_index), "--topics", str(topics), "--hits", "6", "--quiet"]
    assert search_cli.main(common + ["--output", str(tmp_path / "run.trec")]) == 0
    assert search_cli.main(common + ["--output", str(tmp_path / "run.msmarco"), "--output-format", "msmarco"]) == 0
    assert search_cli.main(common + ["--output", str(tmp_path / "run.maxp"), "--max-passage",
                                     "--max-passage-hits", "2"]) == 0
    trec = [line.split() for line in (tmp_path / "run.trec").read_text().splitlines()]
    msmarco = [line.split("\t") for line in (tmp_path / "run.msmarco").read_text().splitlines()]
    assert all(len(row) == 6 and row[1] == "Q0" and row[5] == "AligneR" for row in trec) and len(trec) == 18
    assert msmarco == [[qid, docid, rank] for qid, _, docid, rank, _, _ in trec]
    maxp = [line.split() for line in (tmp_path / "run.maxp").read_text().splitlines()]
    for qid in QUERIES:
        passages = [row[2] for row in trec if row[0] == qid]
        best_docs = list(dict.fromkeys(p.split("#")[0] for p in passages))[:2]
        assert [(row[2], row[3]) for row in maxp if row[0] == qid] == [(d, str(r)) for r, d in enumerate(best_docs, 1)]


def test_write_run_refuses_other_formats(tmp_path):
    with pytest.raises(ValueError, match="output format must be one of"):
        write_run({"q": [("d", 1.0)]}, tmp_path / "run.kilt", tag="t", output_format="kilt")
    assert list(tmp_path.iterdir()) == []


def test_query_max_length(index_dir):
    args = search_cli.build_parser().parse_args(["--index", "i", "--topics", "t", "--output", "o",
                                                 "--query-max-length", "8"])
    assert search_cli.search_options(args).query_max_length == 8
    query = " ".join(QUERIES.values()) * 3
    short = AlignerSearcher(index_dir, query_max_length=6)
    full = AlignerSearcher(index_dir)
    assert short.model.encode_padded([query], is_query=True, maxlen=6).mask.shape[1] == 6
    assert [h.docid for h in short.search(query, k=5)] != [h.docid for h in full.search(query, k=5)] or \
        [h.score for h in short.search(query, k=5)] != pytest.approx([h.score for h in full.search(query, k=5)])
    with pytest.raises(ValueError, match="query_max_length 100000 exceeds"):
        AlignerSearcher(index_dir, query_max_length=100000)


# indexing progress


def test_corpus_counts_give_the_progress_total(tmp_path, capsys):
    docs = [{"id": f"d{i}", "contents": f"document number {i} about bone density"} for i in range(3)]
    array = tmp_path / "array.json"
    array.write_text(json.dumps(docs))
    lines = tmp_path / "lines.json"
    lines.write_text("\n".join(json.dumps(d) for d in docs) + "\n\n")
    assert count_corpus(array) == count_corpus(lines) == 3
    assert index_cli.main(["--corpus", str(array), "--index", str(tmp_path / "index"), "--codec", "fp16"]) == 0
    err = capsys.readouterr().err
    assert "3/3" in err and "<" in err  # total and ETA
    assert index_cli.main(["--corpus", str(lines), "--index", str(tmp_path / "quiet"), "--codec", "fp16",
                           "--quiet"]) == 0
    assert "3/3" not in capsys.readouterr().err


# --encoder <checkpoint folder> in Pyserini's CLIs


def test_checkpoint_folder_is_told_by_its_config(tmp_path):
    mine = tmp_path / "balance-ckpt"  # "ance" inside: Pyserini's keyword match would take it for ANCE
    mine.mkdir()
    shutil.copy(CHECKPOINT / "config.json", mine / "config.json")
    other = tmp_path / "hf-model"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    assert is_aligner_checkpoint(mine) and not is_aligner_checkpoint(other) and not is_aligner_checkpoint(tmp_path)

    class Encode:  # Pyserini's encoder maps, as pyserini.encode holds them
        query_encoder_class_map = {"ance": "AnceQueryEncoder", "aligner": "aligner"}
        document_encoder_class_map = {"ance": "AnceDocumentEncoder"}

    register_checkpoint_encoders(Encode, [str(mine)])
    chosen = next(v for k, v in Encode.query_encoder_class_map.items() if k in str(mine).lower())
    assert callable(chosen) and chosen.__name__ == "_aligner_query_encoder"
    assert Encode.query_encoder_class_map["ance"] == "AnceQueryEncoder"


def test_pyserini_faiss_cli_takes_a_checkpoint_folder(index_dir, topics, tmp_path):
    folder = tmp_path / "balance-ckpt"
    shutil.copytree(CHECKPOINT, folder)
    output = tmp_path / "run.trec"
    assert run_module("pyserini.search.faiss", "--index", str(index_dir), "--encoder", str(folder), "--topics",
                      str(topics), "--output", str(output), "--hits", "3") == 0
    assert {qid: len(hits) for qid, hits in read_run(output).items()} == {qid: 3 for qid in QUERIES}


# argparse types: the typed value the library takes, or an error naming the flag


@pytest.mark.parametrize("parse, text, value", [
    (shared.strategy, "top-k:1", Strategy("top-k", k=1)), (shared.strategy, "top-p:0.02", Strategy("top-p", p=0.02)),
    (shared.strategy, "da:4:0.04", Strategy("da", k=4, eps=0.04)), (codec_arg, "auto", AUTO_CODEC),
    (codec_arg, "FP16", CodecSpec()), (codec_arg, "IVF4096,PQ16", CodecSpec(4096, 16)),
    (codec_arg, "IVF64,PQ4,Refine(PQ32)", CodecSpec(64, 4, 32)), (shared.positive_int, "3", 3),
    (shared.fraction, "1", 1.0), (shared.non_negative, "0", 0.0), (shared.positive_number, "0.5", 0.5),
    (shared.device, "cpu", "cpu")])
def test_argparse_types_give_typed_values(parse, text, value):
    assert parse(text) == value and type(parse(text)) is type(value)


@pytest.mark.parametrize("parse, text, message", [
    (shared.strategy, "top-q:1", "bad alignment strategy 'top-q:1'"),
    (shared.strategy, "top-k:0", "top-k needs an integer k >= 1"), (shared.strategy, "top-p:2", "0 < p <= 1"),
    (codec_arg, "PQ8", "bad codec 'PQ8': expected 'auto', 'fp16'"),
    (codec_arg, "IVF70000,PQ8", "nlist must be in [2, 65536]"),
    (codec_arg, "IVF64,PQ8,Refine(PQ8)", "must be finer than PQ8"),
    (shared.positive_int, "0", "expected an integer >= 1, got '0'"), (shared.positive_int, "x", "got 'x'"),
    (shared.fraction, "0", "expected a number in (0, 1], got '0'"), (shared.non_negative, "nan", "got 'nan'"),
    (shared.positive_number, "inf", "expected a number > 0"), (shared.device, "gpu", "expected cpu or cuda[:N]")])
def test_argparse_types_refuse_bad_values(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        parse(text)


@pytest.mark.parametrize("parser, argv, message", [
    (index_cli.build_parser, ["--corpus", "c", "--index", "i", "--codec", "IVF64,PQ"],
     "argument --codec: bad codec 'IVF64,PQ'"),
    (search_cli.build_parser, ["--index", "i", "--topics", "t", "--output", "o", "--strategy", "da:4"],
     "argument --strategy: bad alignment strategy 'da:4'"),
    (search_cli.build_parser, ["--index", "i", "--topics", "t", "--output", "o", "--query-prune", "0"],
     "argument --query-prune: expected a number in (0, 1], got '0'"),
], ids=["index-codec", "search-strategy", "search-query-prune"])
def test_a_bad_flag_value_is_an_argparse_error_naming_the_flag(parser, argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        parser().parse_args(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    ([], "error: --distributed runs under torchrun (RANK, WORLD_SIZE and MASTER_ADDR are not set)"),
    (["--backend", "faiss"], "error: --distributed searches with backend torch, not --backend faiss")])
def test_distributed_search_flags_that_cant_work_are_usage_errors(topics, tmp_path, capsys, monkeypatch, flags,
                                                                   message):
    monkeypatch.delenv("RANK", raising=False)
    assert search_cli.main(["--index", str(tmp_path), "--topics", str(topics), "--output", str(tmp_path / "run"),
                            "--distributed", *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [message]


def test_flags_reach_the_library_typed():
    args = search_cli.build_parser().parse_args(["--index", "i", "--topics", "t", "--output", "o", "--strategy",
                                                 "top-p:0.02"])
    assert search_cli.search_options(args).strategy == Strategy("top-p", p=0.02)
    args = index_cli.parse_args(["--corpus", "c", "--index", "i", "--codec", "IVF64,PQ8", "--prune-redundancy", "off"])
    fields = index_cli.option_flags(args)
    assert fields["codec"] == CodecSpec(64, 8) and fields["prune_redundancy"] is None
    assert "doc_prune" not in fields  # not given: the default, or the source index's with --from-index


# the runner: one exit-status convention and one logging set-up


def runner_parse(argv):
    parser = argparse.ArgumentParser(prog="probe")
    parser.add_argument("--fail", choices=["usage", "value", "os", "interrupt", "exit", "bug"])
    shared.add_quiet_flag(parser)
    return parser.parse_args(argv)


def runner_command(args):
    failures = {"usage": shared.UsageError("--fail usage: that flag can't go here"),
                "value": ValueError("the index is\nbroken"), "os": FileNotFoundError("no such file: x"),
                "interrupt": KeyboardInterrupt(), "exit": SystemExit("error: stopped"), "bug": KeyError("k")}
    if args.fail:
        raise failures[args.fail]
    logging.getLogger("pyserini_aligner.probe").info("working")
    return None


@pytest.mark.parametrize("argv, status, err", [
    ([], 0, ""), (["--help"], 0, None), (["--bogus"], 2, "probe: error: unrecognized arguments: --bogus"),
    (["--fail", "usage"], 2, "error: --fail usage: that flag can't go here"),
    (["--fail", "value"], 1, "error: the index is broken"), (["--fail", "os"], 1, "error: no such file: x"),
    (["--fail", "interrupt"], 130, "interrupted"), (["--fail", "exit"], 1, "error: stopped")])
def test_runner_exit_status(argv, status, err, capsys):
    assert shared.run_main(runner_parse, runner_command, argv) == status
    text = capsys.readouterr().err
    if err is not None:
        assert text.strip().splitlines()[-1:] == ([err] if err else []) and "Traceback" not in text


def test_runner_lets_a_bug_show_its_traceback():
    with pytest.raises(KeyError):
        shared.run_main(runner_parse, runner_command, ["--fail", "bug"])


def test_runner_quiet_keeps_warnings_only(caplog):
    shared.run_main(runner_parse, runner_command, [])
    assert logging.getLogger().level == logging.INFO and "working" in caplog.text
    caplog.clear()
    shared.run_main(runner_parse, runner_command, ["--quiet"])
    assert logging.getLogger().level == logging.WARNING and "working" not in caplog.text
    assert logging.getLogger("faiss").level == logging.WARNING and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    logging.getLogger().setLevel(logging.INFO)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:") or ": error:" in line]


@pytest.mark.parametrize("module, argv, message", [
    ("pyserini_aligner.index", ["--corpus", "c", "--index", "i", "--codec", "PQ8"], "argument --codec: bad codec"),
    ("pyserini_aligner.search", ["--index", "i", "--topics", "t", "--output", "o", "--hits", "0"],
     "argument --hits: expected an integer >= 1"),
    ("pyserini_aligner.adapt", ["--index", "i", "--topics", "t", "--qrels", "q", "--strategies", "top-k:0"],
     "argument --strategies: bad alignment strategy 'top-k:0'"),
    ("pyserini_aligner.explain", ["--index", "i", "--query", "q", "--strategy", "top"],
     "argument --strategy: bad alignment strategy 'top'"),
    ("pyserini_aligner.serve", ["--index", "a=b", "--rest", "--max-batch", "0"], "argument --max-batch: expected"),
    ("pyserini_aligner.train", ["--config", "c.yaml", "--device", "gpu"], "argument --device: expected cpu or cuda"),
    ("pyserini_aligner.index.merge", ["--inputs", "a", "--index", "b", "--bogus"], "unrecognized arguments: --bogus"),
    ("pyserini_aligner.train.prepare", ["--depth", "0"], "argument --depth: expected an integer >= 1"),
    ("pyserini_aligner.checkpoints.make_default", [], "the following arguments are required: --output"),
], ids=lambda value: value.rsplit(".", 1)[-1] if isinstance(value, str) and value.startswith("pyserini") else None)
def test_every_command_line_gives_2_for_a_usage_error(module, argv, message, capsys):
    status = run_module(module, *argv)
    stderr = capsys.readouterr().err
    assert status == 2 and "Traceback" not in stderr, stderr[-2000:]
    assert len(error_lines(stderr)) == 1 and message in error_lines(stderr)[0], stderr[-2000:]


@pytest.mark.parametrize("module, argv, message", [
    ("pyserini_aligner.index", ["--verify", "--index", "{tmp}/missing"], "index folder not found: {tmp}/missing"),
    ("pyserini_aligner.search", ["--index", "{tmp}/missing", "--topics", "{topics}", "--output", "{tmp}/run.trec"],
     "index folder not found: {tmp}/missing"),
    ("pyserini_aligner.adapt", ["--index", "{tmp}/missing", "--topics", "{topics}", "--qrels", "{tmp}/missing.qrels"],
     "{tmp}/missing"),
    ("pyserini_aligner.explain", ["--index", "{tmp}/missing", "--query", "bone"], "{tmp}/missing"),
    ("pyserini_aligner.index.merge", ["--inputs", "{tmp}/missing", "--index", "{tmp}/merged"], "{tmp}/missing"),
], ids=["index", "search", "adapt", "explain", "merge"])
def test_every_command_line_gives_1_and_one_line_for_a_run_time_error(module, argv, message, topics, tmp_path,
                                                                     capsys):
    def fill(text: str) -> str:
        return text.format(tmp=tmp_path, topics=topics)

    status = run_module(module, *map(fill, argv))
    stderr = capsys.readouterr().err
    assert status == 1 and "Traceback" not in stderr, stderr[-2000:]
    errors = error_lines(stderr)
    assert len(errors) == 1 and fill(message) in errors[0], stderr[-2000:]
