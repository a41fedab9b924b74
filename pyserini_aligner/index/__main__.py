"""``python -m pyserini_aligner.index --corpus <JsonCollection | ir_datasets id> --index <dir> ...``
(or ``--from-index <dir>`` to re-prune / re-FAISS an existing index without re-encoding)."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pyserini_aligner.cli import INTERRUPTED_EXIT, fraction, positive_int
from pyserini_aligner.index.builder import DEFAULT_INDEX_TYPE, build_index, derive_index
from pyserini_aligner.index.corpus import read_corpus
from pyserini_aligner.salience import DEFAULT_PRUNE_REDUNDANCY


def redundancy_arg(text: str) -> float | str:
    """--prune-redundancy value: "off" or a cosine threshold in (0, 1]."""
    if text.lower() == "off":
        return "off"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'off' or a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected 'off' or a number in (0, 1], got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pyserini_aligner.index",
                                     description="Build a multi-vector AligneR index (token vectors + FAISS).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", help="JsonCollection .jsonl/.json file or folder (fields id, contents), "
                                         "a BEIR folder (corpus.jsonl with _id, title, text) "
                                         "or an ir_datasets id such as beir/scifact")
    source.add_argument("--from-index", metavar="DIR",
                        help="derive from an existing fp16 index without re-encoding (new --doc-prune, "
                             "--index-type or --codec)")
    parser.add_argument("--index", required=True, help="output index folder")
    parser.add_argument("--encoder", default="aligner", help="'aligner' or an AligneR checkpoint folder")
    parser.add_argument("--doc-prune", type=fraction, default=None, metavar="BETA",
                        help="fraction β^d of each document's most salient tokens put in FAISS (default 1.0)")
    parser.add_argument("--prune-redundancy", type=redundancy_arg, default=None, metavar="COS",
                        help="redundancy-aware β^d pruning: a token within cosine COS of a more salient token of its "
                             "document goes to FAISS only if the distinct tokens leave room; 'off' prunes by "
                             f"salience alone (default {DEFAULT_PRUNE_REDUNDANCY} when building, the source's "
                             "with --from-index)")
    parser.add_argument("--index-type", default=None,
                        help=f"FAISS factory string, e.g. {DEFAULT_INDEX_TYPE} (default), IVF256,Flat, "
                             "IVF256,PQ16x8, HNSW32")
    parser.add_argument("--codec", default="fp16",
                        help="token store: fp16 (default) or IVF<nlist>,PQ<M>, a compressed residual codec whose "
                             "codes FAISS searches directly (--index-type is then ignored), e.g. IVF4096,PQ16")
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--max-docs", type=positive_int, default=None, help="index only the first N documents")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing index folder")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def corpus_name(spec: str) -> str:
    """What the manifest records as the corpus: an absolute path for files/folders, else the ir_datasets id."""
    return str(Path(spec).resolve()) if Path(spec).exists() else spec


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pyserini_aligner").setLevel(logging.WARNING if args.quiet else logging.INFO)
    common = dict(progress=not args.quiet, overwrite=args.overwrite)
    redundancy = None if args.prune_redundancy == "off" else args.prune_redundancy
    try:
        if args.from_index:
            manifest = derive_index(args.from_index, args.index, doc_prune=args.doc_prune, index_type=args.index_type,
                                    codec=args.codec, device=args.device,
                                    prune_redundancy="source" if args.prune_redundancy is None else redundancy,
                                    **common)
        else:
            manifest = build_index(read_corpus(args.corpus), args.index, args.encoder,
                                   doc_prune=1.0 if args.doc_prune is None else args.doc_prune,
                                   index_type=args.index_type or DEFAULT_INDEX_TYPE, batch_size=args.batch_size,
                                   device=args.device, max_docs=args.max_docs, corpus_name=corpus_name(args.corpus),
                                   codec=args.codec,
                                   prune_redundancy=DEFAULT_PRUNE_REDUNDANCY if args.prune_redundancy is None
                                   else redundancy, **common)
    except (ValueError, OSError) as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:  # the builder has removed its temporary folder
        print("interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
    if not args.quiet:
        print(f"{args.index}: {manifest.num_docs} documents, {manifest.num_tokens} tokens, "
              f"{manifest.num_kept} in FAISS ({manifest.index_type}), codec {manifest.codec}")


if __name__ == "__main__":
    main()
