"""Shared test set-up: real BEIR data from ../shared, linked into a writable ir_datasets home; the shipped model
loaded once per session."""
import copy
import re
import subprocess
import sys
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from workers import built_once

REPO = Path(__file__).resolve().parents[1]
SHARED_BEIR = REPO.parent / "shared" / "data" / "beir"

os.environ.setdefault("PYSERINI_ALIGNER_BEIR_DIR", str(SHARED_BEIR))
os.environ.setdefault("IR_DATASETS_HOME", str(REPO / ".cache" / "ir_datasets"))
# the query encoders exported for ONNX Runtime by the tests' models go beside the clone, not into the home folder
os.environ.setdefault("PYSERINI_ALIGNER_CACHE", str(REPO / ".cache" / "pyserini-aligner"))
# searches are compared with references encoded by torch to float32 rounding: queries go through ONNX Runtime in
# float32; the default 8-bit graph is tested against torch in tests/test_onnx_runtime.py
os.environ.setdefault("PYSERINI_ALIGNER_QUERY_RUNTIME", "onnx")


def share_the_cores() -> None:
    """With several test workers (pytest-xdist), each worker and the processes it starts get an equal share of the
    cores for their OpenMP threads (torch, FAISS) unless OMP_NUM_THREADS is set, and OpenMP threads that wait
    sleep instead of spinning (unless OMP_WAIT_POLICY is set): spinning threads of processes that share the cores
    hold them from the threads they wait for, and torch's work then takes several times as long."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


share_the_cores()  # before torch is imported: it reads OMP_NUM_THREADS once


def interpret_triton() -> None:
    """Without a GPU, the Triton kernels are tested through Triton's CPU interpreter, which Triton reads from
    TRITON_INTERPRET when it is first imported (torch may import it before any kernel test runs)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


interpret_triton()


def make_beir_folder(folder: Path, name: str = "scifact", n_docs: int = 300, split: str = "test",
                     words: int | None = None, max_docs: int | None = None) -> Path:
    """A small local BEIR folder cut from the real zip: the first ``n_docs`` docs (each text cut to its first
    ``words`` words, if given) and the test queries whose judged docs are all among them, with their judgements.
    With ``max_docs``, only the judged docs and the first others are kept, ``max_docs`` in all (corpus order)."""
    with zipfile.ZipFile(Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / f"{name}.zip") as archive:
        docs = [json.loads(line) for line in archive.read(f"{name}/corpus.jsonl").decode().splitlines()]
        queries = [json.loads(line) for line in archive.read(f"{name}/queries.jsonl").decode().splitlines()]
        qrels_rows = archive.read(f"{name}/qrels/{split}.tsv").decode().splitlines()[1:]
    if words is not None:
        docs = [{**doc, "text": " ".join(doc["text"].split()[:words])} for doc in docs[:n_docs]]
    kept = {doc["_id"] for doc in docs[:n_docs]}
    judged: dict[str, set] = {}
    for row in qrels_rows:
        qid, docid, _ = row.split("\t")
        judged.setdefault(qid, set()).add(docid)
    qids = {qid for qid, ids in judged.items() if ids <= kept}
    docs = docs[:n_docs]
    if max_docs is not None:
        needed = set().union(*(judged[qid] for qid in qids))
        others = max_docs - len(needed)
        docs = [doc for doc in docs if doc["_id"] in needed or (others := others - 1) >= 0]
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    with (folder / "corpus.jsonl").open("w") as out:
        for doc in docs:
            out.write(json.dumps(doc) + "\n")
    with (folder / "queries.jsonl").open("w") as out:
        for query in queries:
            if query["_id"] in qids:
                out.write(json.dumps(query) + "\n")
    with (folder / "qrels" / f"{split}.tsv").open("w") as out:
        out.write("query-id\tcorpus-id\tscore\n")
        out.writelines(row + "\n" for row in qrels_rows if row.split("\t")[0] in qids)
    return folder


@pytest.fixture(scope="session")
def scifact_small(tmp_path_factory) -> Path:
    """A 150-document SciFact BEIR folder (texts cut to 64 words) with the test queries fully judged inside it (those
    of the first 300 documents)."""
    with built_once(tmp_path_factory, "scifact_small") as folder:
        if not (folder / "qrels" / "test.tsv").is_file():
            folder.mkdir(exist_ok=True)
            make_beir_folder(folder, words=64, max_docs=150)
    return folder


N_DOCS = 200  # documents of the shared SciFact indexes
DOC_WORDS = 96  # words of each document's text in the shared indexes (the title comes first)


def scifact_docs(n: int, words: int | None = None) -> list[dict]:
    """The first n SciFact documents as JsonCollection records (contents = title + text, the text cut to its first
    ``words`` words if given)."""
    records = []
    with zipfile.ZipFile(Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip") as archive, \
            archive.open("scifact/corpus.jsonl") as lines:
        for line in lines:
            if len(records) == n:
                break
            doc = json.loads(line)
            text = doc["text"] if words is None else " ".join(doc["text"].split()[:words])
            records.append({"id": doc["_id"], "contents": f"{doc['title']} {text}".strip()})
    return records


@pytest.fixture(scope="session", autouse=True)
def shipped_model_cache():
    """``AlignerModel.from_pretrained("aligner")`` on the CPU reads the shipped checkpoint once per session; each call
    (from a test or from library code run in-process) gets its own deep copy, free to change. Other folders and
    devices load as usual."""
    from pyserini_aligner.model import DEFAULT_CHECKPOINT, AlignerModel, resolve_dtype

    load = AlignerModel.from_pretrained.__func__
    loaded: list = []

    def from_pretrained(cls, name_or_path="aligner", device="cpu", dtype=None):
        shipped = str(name_or_path) == "aligner" or Path(name_or_path).resolve() == DEFAULT_CHECKPOINT.resolve()
        if cls is not AlignerModel or not shipped or str(device or "cpu") != "cpu":
            return load(cls, name_or_path, device, dtype)
        if not loaded:
            loaded.append(load(cls, "aligner"))
        model = copy.deepcopy(loaded[0])
        model.compute_dtype = resolve_dtype(dtype)
        return model

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AlignerModel, "from_pretrained", classmethod(from_pretrained))
        yield loaded


@pytest.fixture(scope="session")
def model(shipped_model_cache):
    """The shipped AligneR model (real MiniLM weights), shared by the session: tests that change it copy it first
    or undo the change (monkeypatch)."""
    from pyserini_aligner.model import AlignerModel

    return AlignerModel.from_pretrained("aligner")


def jsonl_once(tmp_path_factory, name: str, records) -> Path:
    """``records`` (a callable giving the documents) as the JsonCollection file ``name``, written once per session."""
    with built_once(tmp_path_factory, name) as path:
        if not path.is_file():
            path.write_text("".join(json.dumps(r) + "\n" for r in records()))
    return path


def exact_index_once(tmp_path_factory, name: str, model, corpus: Path) -> Path:
    """An exact index (codec fp16, β^d = 1, FAISS Flat) of the JsonCollection ``corpus``, built once per session."""
    from pyserini_aligner.index import build_index, read_json_collection
    from pyserini_aligner.index.format import MANIFEST

    with built_once(tmp_path_factory, name) as target:
        if not (target / MANIFEST).is_file():
            build_index(read_json_collection(corpus), target, model, codec="fp16", doc_prune=1.0,
                        progress=False, model_name="aligner")
    return target


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    """The first 200 SciFact documents (texts cut to DOC_WORDS words) as a JsonCollection file."""
    return jsonl_once(tmp_path_factory, "scifact200.jsonl", lambda: scifact_docs(N_DOCS, DOC_WORDS))


@pytest.fixture(scope="session")
def index_dir(tmp_path_factory, model, corpus_file) -> Path:
    """Exact index of the first 200 SciFact documents (built once per session)."""
    return exact_index_once(tmp_path_factory, "scifact200_fp16", model, corpus_file)


@pytest.fixture(scope="session")
def default_index(tmp_path_factory, index_dir) -> Path:
    """The same 200 documents stored as build_index's defaults store them (codec auto = IVF<nlist>,PQ4,Refine(PQ32), β^d 0.2 with
    the redundancy rule), derived once from ``index_dir`` without encoding them again (build_index's defaults
    themselves: tests/test_index.py)."""
    from pyserini_aligner.index import derive_index
    from pyserini_aligner.index.format import MANIFEST
    from pyserini_aligner.index.options import DEFAULT_CODEC, DEFAULT_DOC_PRUNE
    from pyserini_aligner.salience import DEFAULT_PRUNE_REDUNDANCY

    with built_once(tmp_path_factory, "scifact200_default") as target:
        if not (target / MANIFEST).is_file():
            derive_index(index_dir, target, codec=DEFAULT_CODEC, doc_prune=DEFAULT_DOC_PRUNE,
                         prune_redundancy=DEFAULT_PRUNE_REDUNDANCY, progress=False)
    return target


@pytest.fixture(scope="session")
def two_segment_index(tmp_path_factory, model) -> Path:
    """The 200 documents (texts cut to 32 words) as two segments sharing one codec: halves built apart (the second
    with ``codec_from`` the first), then one manifest listing both segments."""
    from pyserini_aligner.index import build_index, read_manifest
    from pyserini_aligner.index.commit import write_manifest
    from pyserini_aligner.index.format import MANIFEST

    with built_once(tmp_path_factory, "scifact200_two_segments") as target:
        if not (target / MANIFEST).is_file():
            base = target.parent
            docs = [(r["id"], r["contents"]) for r in scifact_docs(N_DOCS, 32)]
            first, second = base / "scifact200_first_half", base / "scifact200_second_half"
            build_index(docs[:N_DOCS // 2], first, model, progress=False, model_name="aligner", codec="IVF64,PQ4")
            build_index(docs[N_DOCS // 2:], second, model, progress=False, model_name="aligner", codec_from=first)
            manifest, other = read_manifest(first), read_manifest(second)
            work = base / "scifact200_two_segments.work"
            shutil.copytree(first, work)
            shutil.copytree(second / other.segments[0].name, work / other.segments[0].name)
            manifest.segments += other.segments
            write_manifest(work, manifest)
            work.rename(target)
    return target


class Killed(BaseException):
    """Raised at a fault point by :func:`killed_at`; a BaseException, so that the write unwinds as a kill stops it."""


def killed_at(point: str, folder: Path, snapshot: Path, write) -> None:
    """Run ``write()`` in this process as if SIGKILL struck at fault point ``point``: ``folder`` is copied to
    ``snapshot`` as it stands on disk at that moment (what a killed process leaves behind: the bytes written so far,
    no lock held), then the write is unwound. A write that never reaches ``point`` fails the test. A real kill of a
    child process at a fault point (``PYSERINI_ALIGNER_FAULT``) is tested apart."""
    from pyserini_aligner.index import faults

    def reached(name: str) -> None:
        if name == point:
            shutil.copytree(folder, snapshot, symlinks=True)
            raise Killed(point)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(faults, "point", reached)
        with pytest.raises(Killed):
            write()


def assert_same_ranking(got: list[tuple[str, float]], want: list[tuple[str, float]], atol: float = 1e-6,
                        rtol: float = 0.0) -> None:
    """Same docids in the same order; scores equal within ``atol`` + ``rtol``·|score| (float32 rounding: a CPU's
    products can differ in the last bit with the rows around them)."""
    import numpy as np  # here: numpy's BLAS reads the thread settings when it is first imported

    assert [docid for docid, _ in got] == [docid for docid, _ in want]
    assert np.allclose([s for _, s in got], [s for _, s in want], rtol=rtol, atol=atol)


def assert_same_run(got: Path, want: Path, atol: float = 2e-6) -> None:
    """Two TREC run files: the same queries, each with the same docids in the same order (:func:`assert_same_ranking`)
    and scores equal to float32 rounding as printed (6 decimals: a last bit of difference can change the sixth).
    Runs of other processes or devices are compared so, never as text."""
    from pyserini_aligner.trec import read_run

    ours, theirs = read_run(got), read_run(want)
    assert list(ours) == list(theirs)
    for qid, hits in theirs.items():
        assert_same_ranking(list(ours[qid].items()), list(hits.items()), atol=atol)


def cli_error(main, *args) -> str:
    """The one line that a command line's ``main`` (run in this process on ``args``) prints when it fails with exit
    status 1, the run-time error convention; asserts that it does."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main([*map(str, args)])
    lines = [line for line in err.getvalue().splitlines() if line.startswith("error: ")]
    assert status == 1 and len(lines) == 1 and "Traceback" not in err.getvalue(), (status, err.getvalue()[-2000:])
    return lines[0]


def run_module(module: str, *args: str) -> int:
    """``python -m <module> <args>`` in this process (through the same import hooks); its exit status."""
    import runpy
    import sys
    import warnings

    saved = sys.argv
    sys.argv = [module, *map(str, args)]
    try:
        with warnings.catch_warnings():  # a __main__ module that a test imported already runs again, as in a child
            warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)  # as the interpreter does with sys.exit("message")
        return 1
    finally:
        sys.argv = saved
    return 0


def run(*args, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python <args>`` with this interpreter, from the repository root."""
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def messages(stderr: str) -> list[str]:
    """The lines of ``stderr`` less progress bars, log lines and Java's start-up notes."""
    lines = [line.strip() for line in re.split(r"[\r\n]", stderr)]
    return [line for line in lines if line and "%|" not in line and not re.match(r"(WARNING|INFO|[A-Z][a-z]{2} \d)",
                                                                                   line)]


def one_line_error(result: subprocess.CompletedProcess, status: int, text: str) -> str:
    """The one ``error:`` line of a failed command, asserted to hold ``text``, with exit ``status``, no traceback."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in messages(result.stderr) if line.startswith("error:") or ": error:" in line]
    assert result.returncode == status and len(errors) == 1 and text in errors[0], (result.returncode,
                                                                                    result.stderr[-3000:])
    return errors[0]


def stale_run(folder: Path) -> Path:
    """A run file at ``folder/run.trec`` that a failed search must remove."""
    path = folder / "run.trec"
    path.write_text("q1 Q0 stale 1 1.0 OLD\n")
    return path


FIELDED_DOCS = 60  # documents of the index that stores fields
JOURNALS = ("Nature", "Cell", "Science")


def fielded_records() -> list[dict]:
    """The first FIELDED_DOCS SciFact documents (texts cut to 32 words) as JsonCollection records with fields besides
    ``id`` and ``contents``: ``year`` 2000 + i % 10 (a number), ``kind`` "even" or "odd" (i % 2), ``journal`` one of
    JOURNALS, left out of every fifth document."""
    records = []
    for i, record in enumerate(scifact_docs(FIELDED_DOCS, 32)):
        record.update(year=2000 + i % 10, kind="odd" if i % 2 else "even")
        if i % 5:
            record["journal"] = JOURNALS[i % 3]
        records.append(record)
    return records


@pytest.fixture(scope="session")
def fielded_corpus(tmp_path_factory) -> Path:
    """:func:`fielded_records` as a JsonCollection file."""
    return jsonl_once(tmp_path_factory, "fielded.jsonl", fielded_records)


@pytest.fixture(scope="session")
def fielded_index(tmp_path_factory, model, fielded_corpus) -> Path:
    """An exact index of :func:`fielded_corpus`, its fields stored with it."""
    return exact_index_once(tmp_path_factory, "fielded_fp16", model, fielded_corpus)


@pytest.fixture(scope="session")
def fielded_lucene(tmp_path_factory) -> Path:
    """A Lucene index (BM25, raw documents stored) of the documents of :func:`fielded_corpus`."""
    from pyserini_aligner.bm25 import build_lucene_index
    from pyserini_aligner.data import Doc

    with built_once(tmp_path_factory, "fielded_lucene") as target:
        if not target.is_dir():
            build_lucene_index((Doc(r["id"], "", r["contents"]) for r in fielded_records()), target)
    return target
