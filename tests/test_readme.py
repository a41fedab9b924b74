"""The README runs as written.

Which blocks run:
- the ```bash block under the README's ``## Quick start`` heading, verbatim, with ``bash -e`` in a temporary copy of
  the repository's ``examples/quickstart/`` (the block starts with ``cd examples/quickstart``), with this
  interpreter's folder first on ``PATH`` (as an activated virtualenv would have it), once for all the workers of a
  test run;
- every ```python block, verbatim and in README order, each in a fresh namespace of one interpreter, in a copy of
  the folder the quick start left behind (its ``idx`` and ``lucene-idx``), then the live-index block once more;
- every other ```bash block (the command lines), verbatim and in README order, with ``bash -e`` in a copy of that
  folder, a recorder as its ``python`` (tests/recorder.py); the Python commands then run in order in the test's
  process, through the same start-up hook, but for the BM25 and hybrid searches, real child processes (as the
  quick start's are).
Shell examples that can't run here (make, pip, servers, which ``tests/test_serve.py`` starts) are fenced as ```sh.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyserini_aligner.metrics import FILE_DOCID_WIDTHS

from recorder import record, replay, write_recorder
from workers import built_once

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
EXAMPLE = REPO / "examples" / "quickstart"
# commands that open the quick start's Lucene index by its relative path run as child processes: the JVM of this
# process may have started in another folder, and Java resolves relative paths against the folder it started in
LUCENE_COMMANDS = (["-m", "pyserini.search.lucene"], ["-m", "pyserini.search.hybrid"])
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)


def blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of ``text`` in ``language``, in order."""
    return [body for lang, body in BLOCK.findall(text) if lang == language]


def section(text: str, heading: str) -> str:
    """The part of ``text`` under the ``## heading`` line, up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


def env_with_this_python() -> dict:
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.pop("OPENAI_API_KEY", None)
    return env


@pytest.fixture(scope="session")
def quick_start(tmp_path_factory):
    """Run the quick start's bash block, once for all workers; returns (its stdout, the example folder it worked
    in). Tests work in copies of that folder."""
    script = blocks(section(README.read_text(), "Quick start"), "bash")
    assert len(script) == 1, "the quick start has exactly one ```bash block"
    assert len([line for line in script[0].splitlines() if line.strip()]) <= 10
    with built_once(tmp_path_factory, "readme-quick-start") as root:
        folder, stdout = root / "examples" / "quickstart", root / "stdout.txt"
        if not stdout.is_file():
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(EXAMPLE, folder,
                            ignore=shutil.ignore_patterns("idx", "lucene-idx", "run.trec", "__pycache__"))
            done = subprocess.run(["bash", "-e", "-c", script[0]], cwd=root, env=env_with_this_python(),
                                  capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
            stdout.write_text(done.stdout)
    return stdout.read_text(), folder


def test_quick_start_writes_a_run_and_ndcg(quick_start):
    stdout, folder = quick_start
    topics = {line.split("\t")[0] for line in (folder / "topics.tsv").read_text().splitlines()}
    run = [line.split() for line in (folder / "run.trec").read_text().splitlines()]
    assert {row[0] for row in run} == topics
    assert all(len(row) == 6 for row in run)
    trec_eval = re.search(r"^ndcg_cut_10\s+all\s+([0-9.]+)$", stdout, re.M)
    assert trec_eval, stdout[-2000:]
    ranx = re.findall(r"^([0-9.]+)$", stdout, re.M)
    assert ranx, stdout[-2000:]
    # trec_eval and ranx agree, and the shipped model ranks the judged abstracts of these 7 queries high
    assert float(ranx[-1]) == pytest.approx(float(trec_eval.group(1)), abs=1e-4)
    assert float(trec_eval.group(1)) > 0.7
    assert (folder / "lucene-idx").is_dir()
    # make test compiles ranx's file kernels for these widths first (pyserini_aligner.metrics.warm_up)
    for name in ("run.trec", "qrels.txt"):  # the docid is the third column of both
        longest = max(len(line.split()[2]) for line in (folder / name).read_text().splitlines())
        assert longest in FILE_DOCID_WIDTHS, (name, longest)


def test_python_snippets_run(quick_start, tmp_path):
    work = tmp_path / "quickstart"
    shutil.copytree(quick_start[1], work)
    snippets = blocks(README.read_text(), "python")
    assert len(snippets) >= 4
    live = [code for code in snippets if "AlignerIndex(" in code]
    assert len(live) == 1
    runner = ("import sys\n"
              "for number, code in enumerate(sys.argv[1:]):\n"
              "    print(f'--- snippet {number}', flush=True)\n"
              "    exec(compile(code, f'README python block {number}', 'exec'), {'__name__': '__main__'})\n")
    # every snippet in README order, then the live-index snippet once more (it runs again as it is)
    done = subprocess.run([sys.executable, "-c", runner, *snippets, live[0]], cwd=work, env=env_with_this_python(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out, again = done.stdout.split(f"--- snippet {len(snippets)}\n")
    assert out.count("--- snippet") == len(snippets)
    assert "AlignerSearcher" in out  # FaissSearcher on an AligneR index
    assert "\n20 fp16 0.5\n" in out  # build_index with BuildOptions
    assert out.rstrip().endswith("True\nDeleteReport(deleted=1, unknown=[])")  # reopen() found the new generation
    assert again == "True\nDeleteReport(deleted=1, unknown=[])\n"


def test_command_lines_run(quick_start, tmp_path, monkeypatch):
    _, folder = quick_start
    text = README.read_text()
    quick = blocks(section(text, "Quick start"), "bash")
    commands = [code for code in blocks(text, "bash") if code not in quick]
    assert len(commands) >= 5
    work = tmp_path / "quickstart"
    shutil.copytree(folder, work)
    recorder, children = write_recorder(tmp_path / "bin"), 0
    monkeypatch.chdir(work)
    for number, code in enumerate(commands):
        for command in record(["bash", "-e", "-c", code], recorder, tmp_path / f"block{number}.commands",
                              env_with_this_python(), cwd=work):
            if command["argv"][:2] in LUCENE_COMMANDS:
                done = subprocess.run([sys.executable, *command["argv"]], cwd=work, env=env_with_this_python(),
                                      capture_output=True, text=True, timeout=600)
                assert done.returncode == 0, (number, command["argv"], done.stderr[-3000:])
                children += 1
            else:
                replay(command, f"README bash block {number}")
    assert children >= 2, "the README runs a BM25 and a hybrid search"
    topics = {line.split("\t")[0] for line in (folder / "topics.tsv").read_text().splitlines()}
    for run in ("bm25.trec", "hybrid.trec", "fused.trec"):  # the fusion example's inputs are made by the ones above
        assert {line.split()[0] for line in (work / run).read_text().splitlines()} == topics, run
    assert len({line.split()[0] for line in (work / "run.trec").read_text().splitlines()}) == 7  # idx-mix, last
    assert (work / "idx-mix" / "manifest.json").is_file()
    assert "<html" in (work / "explain.html").read_text().lower()


def test_example_data_is_derived_from_scifact(tmp_path):
    """examples/quickstart is what its script writes from the BEIR SciFact zip."""
    done = subprocess.run([sys.executable, str(EXAMPLE / "make_example.py"),
                           str(Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("corpus/docs.jsonl", "topics.tsv", "qrels.txt"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE / name).read_bytes(), name


def test_headline_table_matches_results_files():
    """Each nDCG@10 of the BEIR table of docs/results.md is the one in the results.md that ``make run`` wrote (the
    default index against exact scoring: the harness's run of those systems, ``runs/fidelity_<name>``)."""
    text = (REPO / "docs" / "results.md").read_text()
    table = section(text, "BEIR test sets (`make run`, `make run DATASET=beir/nfcorpus/test`)")
    for column, name in enumerate(("scifact", "nfcorpus")):
        for system in ("bm25", "dense", "aligner", "aligner-exact", "hybrid"):
            run = f"fidelity_{name}" if system in ("aligner", "aligner-exact") else f"beir_{name}_test"
            results = (REPO / "runs" / run / "results.md").read_text()
            row = re.search(rf"^\| {system} \(.*$", table, re.M)
            assert row, system
            readme_value = row.group(0).strip("|").split("|")[1 + column].strip()
            assert re.search(rf"^\| {system} \| {re.escape(readme_value)} \|", results, re.M), (name, system)
