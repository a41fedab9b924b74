"""``python -m pyserini_aligner.index --corpus <JsonCollection | ir_datasets id> --index <dir> ...``
(or ``--from-index <dir>`` to re-prune / re-FAISS an existing index without re-encoding)."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pyserini_aligner.checkpoints import SHIPPED
from pyserini_aligner.cli import (HelpFormatter, UsageError, add_quiet_flag, device, fraction, positive_int,
                                  positive_number, run_main, strategy)
from pyserini_aligner.index.codec_spec import DEFAULT_PQ_M, FP16, AutoCodec
from pyserini_aligner.index.builder import build_index, derive_index
from pyserini_aligner.index.corpus import read_corpus
from pyserini_aligner.index.distributed import DEFAULT_TIMEOUT_S, build_distributed, dist_context
from pyserini_aligner.index.options import (DEFAULT_CODEC, DEFAULT_DOC_PRUNE, DEFAULT_INDEX_TYPE, SCALE_DOC_PRUNE,
                                            SCALE_DOCS, DTYPES, BuildOptions,
                                            codec_arg)
from pyserini_aligner.index.shards import shard_corpus
from pyserini_aligner.index.commit import set_default_strategy
from pyserini_aligner.index.format import read_manifest
from pyserini_aligner.salience import DEFAULT_PRUNE_REDUNDANCY

OFF = "off"  # --prune-redundancy off: prune by salience alone


def redundancy_arg(text: str) -> float | str:
    """--prune-redundancy value: "off" or a cosine threshold in (0, 1]."""
    if text.lower() == OFF:
        return OFF
    try:
        return fraction(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'off' or a number in (0, 1], got {text!r}") from None


def bytes_per_token(text: str) -> int:
    """--max-bytes-per-token value: an integer of at least 2 + DEFAULT_PQ_M (a centroid id and the coarsest
    residual)."""
    least = 2 + DEFAULT_PQ_M
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least} (a 2-byte centroid id and a {DEFAULT_PQ_M}-"
                                         f"byte residual), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyserini_aligner.index",
                                     description="Build a multi-vector AligneR index, derive one from another, or "
                                                 "verify one.",
                                     formatter_class=HelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", help="JsonCollection .jsonl/.json file or folder (fields id, contents), "
                                         "a BEIR folder (corpus.jsonl with _id, title, text) "
                                         "or an ir_datasets id such as beir/scifact")
    source.add_argument("--from-index", metavar="DIR",
                        help="derive from an existing fp16 index without re-encoding (new --doc-prune, "
                             "--index-type or --codec)")
    source.add_argument("--verify", action="store_true",
                        help="check the CRC32 of every file of --index (the large token files included)")
    source.add_argument("--add", metavar="CORPUS", help="encode these documents into the existing --index")
    source.add_argument("--upsert", metavar="CORPUS",
                        help="like --add, replacing the indexed documents with the same ids")
    source.add_argument("--delete", metavar="IDS", help="file of docids (one a line) to delete from --index")
    source.add_argument("--compact", action="store_true",
                        help="rewrite --index without its deleted documents, as one segment")
    parser.add_argument("--retrain-codec", action="store_true",
                        help="with --compact: retrain the codec on the live tokens and re-quantise them")
    parser.add_argument("--strict", action="store_true", help="with --delete: fail on ids not in the index")
    parser.add_argument("--index", required=True, help="index folder")
    parser.add_argument("--encoder", default="aligner",
                        help=f"a shipped checkpoint ({', '.join(SHIPPED)}) or an AligneR checkpoint folder")
    parser.add_argument("--strategy", type=strategy, default=None,
                        help="alignment strategy recorded as the index's default, e.g. top-p:0.01 (default: the "
                             "checkpoint's; with --from-index: the source's)")
    parser.add_argument("--doc-prune", type=fraction, default=None, metavar="BETA",
                        help=f"fraction β^d of each document's most salient tokens indexed for candidate generation "
                             f"(default when building: {DEFAULT_DOC_PRUNE}, {SCALE_DOC_PRUNE} from {SCALE_DOCS:,} documents; the "
                             "source's with --from-index)")
    parser.add_argument("--prune-redundancy", type=redundancy_arg, default=None, metavar="COS",
                        help="redundancy-aware β^d pruning: a token within cosine COS of a more salient token of its "
                             "document is indexed only if the distinct tokens leave room; 'off' prunes by "
                             f"salience alone (default {DEFAULT_PRUNE_REDUNDANCY} when building, the source's "
                             "with --from-index)")
    parser.add_argument("--codec", type=codec_arg, default=None,
                        help=f"token store: '{DEFAULT_CODEC}' (the default: IVF<nlist>,PQ4,Refine(PQ<R>), nlist and "
                             "the residual bytes R chosen from the corpus size and --max-bytes-per-token), "
                             "IVF<nlist>,PQ<M>[,Refine(PQ<R>)], or fp16 (exact vectors plus a FAISS --index-type index)")
    parser.add_argument("--max-bytes-per-token", type=bytes_per_token, default=None, metavar="B",
                        help="with --codec auto: bytes stored per token at most (centroid id and residual code; "
                             "default: a centroid id and 2 bits a dimension as ColBERTv2's residuals, at least 34 "
                             "bytes, and at least 66 from 4M tokens, where finer margins order the top 10: 34 or 66 "
                             "at 128-d, 98 at 384-d)")
    parser.add_argument("--codec-from", metavar="DIR", default=None,
                        help="use the trained codec of that compressed index (shards and updates that must share one)")
    parser.add_argument("--index-type", default=None,
                        help=f"with --codec fp16: FAISS factory string, e.g. {DEFAULT_INDEX_TYPE} (default), "
                             "IVF256,Flat, HNSW32")
    parser.add_argument("--max-length", type=positive_int, default=None,
                        help="tokens per document (default: the model's doc_maxlen, 256 for the shipped model)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="documents encoded together")
    parser.add_argument("--device", type=device, default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="precision the documents are encoded in: auto (fp16 on a GPU, fp32 on a CPU), fp32, "
                             "fp16, or bf16 (about twice as fast on a CPU with AVX512-BF16 or AMX)")
    parser.add_argument("--max-docs", type=positive_int, default=None, help="index only the first N documents")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing index of this package (never any other folder)")
    parser.add_argument("--shard-id", type=int, default=None,
                        help="with --corpus: build only shard i of --shard-num (a contiguous slice, Pyserini's "
                             "convention); merge shards with python -m pyserini_aligner.index.merge")
    parser.add_argument("--shard-num", type=int, default=None, help="number of shards (with --shard-id)")
    parser.add_argument("--dist-timeout", type=positive_number, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help="under torchrun: how long a rank waits for the others before the build fails")
    add_quiet_flag(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.shard_id is None) != (args.shard_num is None) or (args.shard_num is not None and not args.corpus):
        parser.error("--shard-id and --shard-num go together, with --corpus")
    if args.retrain_codec and not args.compact:
        parser.error("--retrain-codec goes with --compact (it retrains the codec of the compacted index)")
    if args.strict and not args.delete:
        parser.error("--strict goes with --delete (it fails on ids that are not in the index)")
    if args.strategy is not None and not (args.corpus or args.from_index):
        parser.error("--strategy goes with --corpus or --from-index (it sets the default strategy of the index "
                     "built)")
    chosen = args.codec or (DEFAULT_CODEC if not args.from_index else FP16)
    if args.max_bytes_per_token is not None and (not isinstance(chosen, AutoCodec) or args.codec_from):
        parser.error("--max-bytes-per-token sizes the residuals of --codec auto; it does nothing with "
                     f"--codec {chosen}{' and --codec-from' if args.codec_from else ''}")
    return args


def option_flags(args: argparse.Namespace) -> dict:
    """The BuildOptions fields that the flags set; a flag left out is absent (the default, or the source index's
    setting with --from-index)."""
    given = dict(doc_prune=args.doc_prune, codec=args.codec, index_type=args.index_type, codec_from=args.codec_from,
                 max_bytes_per_token=args.max_bytes_per_token, max_length=args.max_length, max_docs=args.max_docs,
                 prune_redundancy=args.prune_redundancy)
    fields = {name: None if value == OFF else value for name, value in given.items() if value is not None}
    return dict(fields, batch_size=args.batch_size, device=args.device, dtype=args.dtype, progress=not args.quiet,
                overwrite=args.overwrite)


def corpus_name(spec: str) -> str:
    """What the manifest records as the corpus: an absolute path for files/folders, else the ir_datasets id."""
    return str(Path(spec).resolve()) if Path(spec).exists() else spec


def live_update(args: argparse.Namespace) -> None:
    """--add / --upsert / --delete / --compact on an existing index."""
    from pyserini_aligner.index.live import AlignerIndex

    encoder = None if args.encoder == "aligner" else args.encoder
    index = AlignerIndex(args.index, encoder, device=args.device, batch_size=args.batch_size,
                         progress=not args.quiet, dtype=args.dtype)
    if args.delete:
        path = Path(args.delete)
        try:
            ids = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text ({err})") from None
        report = index.delete(ids, strict=args.strict)
        if report.unknown:
            logging.getLogger("pyserini_aligner").warning("%d id(s) of %s are not in the index, e.g. %s",
                                                          len(report.unknown), path, report.unknown[:3])
        manifest = read_manifest(args.index)
        print(f"{args.index}: deleted {report.deleted}; {manifest.num_docs} live documents")
        return
    if args.compact:
        manifest = index.compact(retrain_codec=args.retrain_codec)
    else:
        manifest = index.add(read_corpus(args.add or args.upsert), upsert=bool(args.upsert))
    print(f"{args.index}: {manifest.num_docs} live documents in {len(manifest.segments)} segment(s), "
          f"generation {manifest.generation}")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (:func:`pyserini_aligner.cli.run_main`)."""
    return run_main(parse_args, run, argv)


def run(args: argparse.Namespace) -> None:
    """Build, derive, verify or update the index the flags name. Every write removes what it had written when it
    fails or is interrupted."""
    if args.verify:
        from pyserini_aligner.index.reader import StoredIndex

        StoredIndex(args.index, verify=True)
        print(f"{args.index}: every file matches its checksum")
        return
    if args.add or args.upsert or args.delete or args.compact:
        live_update(args)
        return
    if args.from_index:
        options = BuildOptions.of_index(read_manifest(args.from_index)).replace(**option_flags(args))
        manifest = derive_index(args.from_index, args.index, options)
    else:
        from pyserini_aligner.index.corpus import count_corpus

        options = BuildOptions(corpus_name=corpus_name(args.corpus), **option_flags(args))
        if dist_context() is not None:  # under torchrun: every rank encodes its slice into one index
            if args.shard_num is not None:
                raise UsageError("--shard-id/--shard-num build one shard per process; under torchrun the ranks "
                                 "split the corpus themselves")
            manifest = build_distributed(args.corpus, args.index, args.encoder, options, timeout_s=args.dist_timeout)
            if manifest is None:  # ranks > 0: rank 0 reports
                return
        else:
            corpus, hint = read_corpus(args.corpus), count_corpus(args.corpus)
            if args.shard_num is not None:
                corpus, start, end, total = shard_corpus(args.corpus, args.shard_id, args.shard_num, args.max_docs)
                if args.shard_num > total:
                    raise ValueError(f"--shard-num {args.shard_num} is larger than the corpus ({total} documents): "
                                     "every shard needs at least one document")
                # β^d of the whole corpus, so that every shard indexes the same share and the shards merge
                hint, options = end - start, options.replace(max_docs=None).sized(total)
            manifest = build_index(corpus, args.index, args.encoder, options, num_docs_hint=hint,
                                   corpus_path=args.corpus if Path(args.corpus).exists() else None)
    if args.strategy is not None:
        manifest = set_default_strategy(args.index, args.strategy)
    if not args.quiet:
        print(f"{args.index}: {manifest.num_docs} documents, {manifest.num_tokens} tokens, "
              f"{manifest.num_kept} indexed, codec {manifest.codec}, strategy {manifest.default_strategy}")


if __name__ == "__main__":
    sys.exit(main())
