"""Data loading through ir_datasets and local BEIR folders, with clear errors."""
import json
import os
import re
import subprocess
import sys

import pytest

from pyserini_aligner.data import BEIR_DIR_ENV, DOCSTORE_LOCK, DataError, Dataset, iter_corpus


def test_ir_datasets_scifact_test():
    dataset = Dataset("beir/scifact/test")
    assert len(dataset.queries()) == 300
    assert sum(len(docs) for docs in dataset.qrels().values()) == 339
    first = next(dataset.docs())
    assert first.docid and first.contents.startswith(first.title)


def test_nfcorpus_splits():
    assert len(Dataset("beir/nfcorpus/dev").queries()) == 324
    assert len(Dataset("beir/nfcorpus/train").qrels()) > 2000


def test_unknown_dataset_id():
    with pytest.raises(DataError, match="unknown dataset ID 'beir/nosuchset/test'"):
        Dataset("beir/nosuchset/test")


def test_missing_data_file(tmp_path, monkeypatch):
    monkeypatch.setenv(BEIR_DIR_ENV, str(tmp_path))  # a BEIR folder without scifact.zip
    monkeypatch.setenv("IR_DATASETS_HOME", str(tmp_path / "home"))
    with pytest.raises(DataError, match=r"data file missing .*scifact\.zip"):
        Dataset("beir/scifact/test")


def test_local_folder(scifact_small):
    dataset = Dataset(str(scifact_small))
    assert sum(1 for _ in dataset.docs()) == 150
    assert set(dataset.queries()) == set(dataset.qrels())


def test_corpus_line_not_json(scifact_small, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    lines = (scifact_small / "corpus.jsonl").read_text().splitlines()
    lines[6] = '{"_id": "x", "text": '
    (broken / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"corpus\.jsonl, line 7: not valid JSON"):
        list(iter_corpus(str(broken)))


def test_missing_field_named(tmp_path):
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"_id": "d1", "title": "t"}) + "\n")
    with pytest.raises(DataError, match=r"line 1: missing field 'text'"):
        list(iter_corpus(str(tmp_path)))


def test_empty_corpus(tmp_path):
    (tmp_path / "corpus.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty corpus"):
        list(iter_corpus(str(tmp_path)))


def test_missing_qrels_file(scifact_small):
    with pytest.raises(DataError, match=r"data file missing: .*qrels/dev\.tsv"):
        Dataset(str(scifact_small), split="dev").qrels()


def test_processes_reading_a_corpus_ir_datasets_has_not_stored_yet_all_read_it_whole(tmp_path):
    """Several processes opening the same ir_datasets corpus in a fresh cache (pytest workers, torchrun ranks): one
    builds the document store while the others wait for it, so none reads a half-written store."""
    script = ("from pyserini_aligner.data import Dataset; "
              "print(sum(1 for _ in Dataset('beir/scifact/test').docs()))")
    env = {**os.environ, "IR_DATASETS_HOME": str(tmp_path / "home")}
    children = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
        assert out.split() == ["5183"]


def _blocked_on(lock, pid: int) -> bool:
    """True once process ``pid`` waits for the flock on file ``lock`` (a ``->`` line of /proc/locks)."""
    inode = f":{os.stat(lock).st_ino} "
    return any("->" in line and f" {pid} " in line and inode in line
               for line in open("/proc/locks").read().splitlines())


def test_a_process_waits_for_the_store_another_is_building_before_it_touches_it(tmp_path):
    """ir_datasets' version check removes a store whose version file is not yet written: a reader must not run it
    while another process holds the build lock (this state is a builder caught between its two steps)."""
    import fcntl
    import time

    home = tmp_path / "home"
    folder = home / "beir" / "scifact"
    (folder / "docs.pklz4").mkdir(parents=True)
    partial = folder / "docs.pklz4" / "bin"
    partial.write_bytes(b"half")
    (folder / "irds_version.txt").write_text("")
    lock = home / DOCSTORE_LOCK
    script = ("from pyserini_aligner.data import Dataset; "
              "print(sum(1 for _ in Dataset('beir/scifact/test').docs()))")
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        child = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "IR_DATASETS_HOME": str(home)},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not _blocked_on(lock, child.pid):
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.05)
        assert partial.read_bytes() == b"half"
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    assert out.split() == ["5183"]


def _queries_in_a_fresh_process(package_file, env: dict) -> subprocess.CompletedProcess:
    """Count the queries of beir/scifact/test in a new interpreter (ir_datasets reads IR_DATASETS_HOME on import)
    whose pyserini_aligner.data believes it lives at ``package_file``."""
    code = ("import sys\nfrom pyserini_aligner import data\ndata.__file__ = sys.argv[1]\n"
            "print(data.find_beir_dir())\nprint(len(data.Dataset('beir/scifact/test').queries()))\n")
    return subprocess.run([sys.executable, "-c", code, str(package_file)], env=env, capture_output=True, text=True,
                          timeout=300)


def test_beir_zips_beside_the_clone_are_found_without_variables(tmp_path):
    """Without PYSERINI_ALIGNER_BEIR_DIR, ``shared/data/beir`` beside the clone (the Makefile's default) is used, and
    IR_DATASETS_HOME may be left unset too; with no zip anywhere, a failed download names the variable to set."""
    zips = tmp_path / "shared" / "data" / "beir"
    zips.mkdir(parents=True)
    (zips / "scifact.zip").symlink_to(os.path.join(os.environ[BEIR_DIR_ENV], "scifact.zip"))
    env = {k: v for k, v in os.environ.items() if k not in (BEIR_DIR_ENV, "IR_DATASETS_HOME")}
    env["HOME"] = str(tmp_path / "home")  # ir_datasets' own default cache, ~/.ir_datasets, is empty
    done = _queries_in_a_fresh_process(tmp_path / "clone" / "pyserini_aligner" / "data.py", env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(zips), "300"]
    assert (tmp_path / "home" / ".ir_datasets" / "beir" / "scifact" / "source.zip").resolve() == \
        (zips / "scifact.zip").resolve()

    env.update(HOME=str(tmp_path / "other-home"), HTTPS_PROXY="http://127.0.0.1:9")  # the download fails at once
    done = _queries_in_a_fresh_process(tmp_path / "a" / "b" / "pyserini_aligner" / "data.py", env)
    assert done.returncode == 1 and done.stdout.split() == ["None"]
    assert re.search(rf"DataError: 'beir/scifact/test': no local copy and the download failed .*; put scifact\.zip "
                     rf"in a folder and set {BEIR_DIR_ENV} to it", done.stderr), done.stderr[-2000:]
