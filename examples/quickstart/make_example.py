"""Write this example's data from BEIR's SciFact zip: 20 abstracts (shortened), 7 test queries, their qrels.

    python examples/quickstart/make_example.py scifact.zip examples/quickstart
"""
import argparse
import json
import zipfile
from pathlib import Path

FIRST_DOCS = 15  # the corpus's first documents, plus every document judged for the queries below
QUERIES = ("1137", "957", "1385", "399", "268", "269", "554")
MAX_CHARS = 300  # abstract text kept per document, cut at a word boundary


def shorten(text: str, limit: int = MAX_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary."""
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("zip", type=Path, help="BEIR scifact.zip")
    parser.add_argument("output", type=Path, help="folder for corpus/docs.jsonl, topics.tsv and qrels.txt")
    args = parser.parse_args()
    with zipfile.ZipFile(args.zip) as archive:
        docs = [json.loads(line) for line in archive.read("scifact/corpus.jsonl").decode().splitlines()]
        queries = [json.loads(line) for line in archive.read("scifact/queries.jsonl").decode().splitlines()]
        qrels = [row.split("\t") for row in archive.read("scifact/qrels/test.tsv").decode().splitlines()[1:]]
    qrels = [row for row in qrels if row[0] in QUERIES]
    judged = {docid for _, docid, _ in qrels}
    kept = [doc for i, doc in enumerate(docs) if i < FIRST_DOCS or doc["_id"] in judged]
    (args.output / "corpus").mkdir(parents=True, exist_ok=True)
    with (args.output / "corpus" / "docs.jsonl").open("w") as out:
        for doc in kept:
            out.write(json.dumps({"id": doc["_id"], "contents": f"{doc['title']} {shorten(doc['text'])}"}) + "\n")
    with (args.output / "topics.tsv").open("w") as out:
        out.writelines(f"{q['_id']}\t{q['text']}\n" for q in queries if q["_id"] in QUERIES)
    with (args.output / "qrels.txt").open("w") as out:
        out.writelines(f"{qid} 0 {docid} {score}\n" for qid, docid, score in qrels)


if __name__ == "__main__":
    main()
