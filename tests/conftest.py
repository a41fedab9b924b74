"""Shared test set-up: real BEIR data from ../shared, linked into a writable ir_datasets home."""
import json
import os
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_BEIR = REPO.parent / "shared" / "data" / "beir"

os.environ.setdefault("PYSERINI_ALIGNER_BEIR_DIR", str(SHARED_BEIR))
os.environ.setdefault("IR_DATASETS_HOME", str(REPO / ".cache" / "ir_datasets"))


def make_beir_folder(folder: Path, name: str = "scifact", n_docs: int = 300, split: str = "test") -> Path:
    """A small local BEIR folder cut from the real zip: the first ``n_docs`` docs plus every doc judged for
    the queries kept (the test queries whose judged docs are all among those docs)."""
    with zipfile.ZipFile(Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / f"{name}.zip") as archive:
        docs = [json.loads(line) for line in archive.read(f"{name}/corpus.jsonl").decode().splitlines()]
        queries = [json.loads(line) for line in archive.read(f"{name}/queries.jsonl").decode().splitlines()]
        qrels_rows = archive.read(f"{name}/qrels/{split}.tsv").decode().splitlines()[1:]
    kept = {doc["_id"] for doc in docs[:n_docs]}
    judged: dict[str, set] = {}
    for row in qrels_rows:
        qid, docid, _ = row.split("\t")
        judged.setdefault(qid, set()).add(docid)
    qids = {qid for qid, ids in judged.items() if ids <= kept}
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    with (folder / "corpus.jsonl").open("w") as out:
        for doc in docs[:n_docs]:
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
    """A 300-document SciFact BEIR folder with the test queries fully judged inside it."""
    return make_beir_folder(tmp_path_factory.mktemp("scifact_small"))
