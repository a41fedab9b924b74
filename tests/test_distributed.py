"""Distributed builds (torchrun, Gloo on the CPU), shard builds + merge, and sharded search: the same codes, docids
and rankings as one process; a rank that dies leaves no index and a message naming it."""
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyserini_aligner.index import StoredIndex, build_index, read_json_collection, read_manifest
from pyserini_aligner.index import __main__ as index_cli
from pyserini_aligner.index import merge as merge_cli
from pyserini_aligner.index.shards import merge_indexes, shard_range
from pyserini_aligner.search.searcher import AlignerSearcher

from conftest import assert_same_ranking, assert_same_run, cli_error
from test_index import short_records, write_jsonl

N_DOCS = 24
QUERIES = ["protein folding in cells", "cancer risk and diet", "gene expression of neurons",
           "bacterial infection treatment"]
TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("dist") / "docs.jsonl", short_records(N_DOCS, words=8))


@pytest.fixture(scope="module")
def single(tmp_path_factory, model, corpus) -> Path:
    """The one-process index of the corpus; its codec is the one every other build here shares."""
    target = tmp_path_factory.mktemp("single") / "idx"
    build_index(read_json_collection(corpus), target, model, codec="IVF8,PQ4", progress=False, model_name="aligner")
    return target


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def same_index(a: Path, b: Path) -> None:
    """Both indexes hold the same documents, tokens, codes and kept tokens, in the same order."""
    x, y = StoredIndex(a), StoredIndex(b)
    assert x.docids == y.docids
    assert np.array_equal(x.offsets, y.offsets)
    everything = np.arange(int(x.offsets[-1]))
    for mine, theirs in zip(x.token_codes(everything), y.token_codes(everything)):
        assert np.array_equal(mine, theirs)
    assert np.array_equal(x.kept, y.kept)
    assert x.manifest.codec_files == y.manifest.codec_files


def ranking(index: Path, **kwargs) -> list:
    return AlignerSearcher(index, **kwargs).rank(QUERIES, k=10)


# what a rank process inherits: nothing of the test process's own set-up (no TRITON_INTERPRET, no OMP_WAIT_POLICY);
# one OpenMP thread, as torchrun gives each rank by default (a build sets its ranks' torch threads itself)
KEPT_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "IR_DATASETS_HOME", "PYSERINI_ALIGNER_BEIR_DIR",
            "PYSERINI_ALIGNER_CACHE", "PYSERINI_ALIGNER_QUERY_RUNTIME")


def run_env(rank: int | None = None, world: int = 2, port: int = 0, **extra) -> dict:
    """The environment of a rank (or of torchrun): explicit and minimal, Python's fault handler on (a rank that
    crashes prints every thread's stack), this checkout first on PYTHONPATH; with ``rank``, the variables torchrun
    would set for it."""
    env = {name: os.environ[name] for name in KEPT_ENV if name in os.environ}
    checkout = str(Path(__file__).parents[1])
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **extra)
    if rank is not None:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
    return env


def torchrun(module: str, *args: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 -m <module> <args>`` (its rendezvous on a free port of its own)."""
    return subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", module, *map(str, args)],
                          env=run_env(), capture_output=True, text=True, timeout=240)


def test_shard_range_follows_pyserini():
    assert [shard_range(10, i, 3) for i in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert shard_range(5, 0, 1) == (0, 5)
    with pytest.raises(ValueError, match="--shard-id must be in"):
        shard_range(10, 3, 3)


def test_torchrun_build_and_search_equal_one_process(tmp_path, single, corpus):
    """torchrun builds one index of two segments (one a rank) equal to the one-process build; torchrun then searches
    it with --distributed into the run a one-process search writes (the same rankings, scores to float32 rounding:
    a rank's BLAS can sum in another order than one process's threads): with --placement shard (a segment a rank)
    and replicate (the index on every rank, each batch split across them; the last batch of one query leaves a rank
    without work). What auto takes on ranks: test_the_split_path_of_gpus_ranks_as_one_process."""
    target = tmp_path / "idx"
    result = torchrun("pyserini_aligner.index", "--corpus", corpus, "--index", target, "--codec-from", single,
                      "--dist-timeout", "60")
    assert result.returncode == 0, result.stderr[-6000:]
    assert f"{target}: {N_DOCS} documents" in result.stdout
    manifest = read_manifest(target)
    assert [s.num_docs for s in manifest.segments] == [12, 12]
    assert manifest.corpus == str(corpus.resolve())
    same_index(single, target)
    assert ranking(target) == ranking(single)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]  # no build folder left
    assert not any(p.name.startswith(".tmp-") for p in target.iterdir())  # status files removed

    topics = tmp_path / "topics.tsv"
    topics.write_text("".join(f"q{i}\t{text}\n" for i, text in enumerate(QUERIES)))
    from pyserini_aligner.search import __main__ as search_cli

    assert search_cli.main(["--index", str(single), "--topics", str(topics), "--output", str(tmp_path / "one.trec"),
                            "--hits", "10", "--quiet"]) == 0
    assert len((tmp_path / "one.trec").read_text().splitlines()) == 10 * len(QUERIES)
    for placement in ("shard", "replicate"):
        output = tmp_path / f"dist-{placement}.trec"
        result = torchrun("pyserini_aligner.search", "--distributed", "--placement", placement, "--index", target,
                          "--topics", topics, "--output", output, "--hits", "10", "--batch-size", "3", "--quiet")
        assert result.returncode == 0, result.stderr[-6000:]
        assert_same_run(output, tmp_path / "one.trec")


def test_torchrun_skips_blank_documents_as_one_process(tmp_path, model):
    """Blank documents in both ranks' slices are skipped, as by a one-process build: the same index."""
    records = short_records(8, words=8)
    for position, text in ((1, ""), (3, "\u200b\x00"), (6, "  "), (9, "\ufeff")):
        records.insert(position, {"id": f"blank-{position}", "contents": text})
    blank_corpus = write_jsonl(tmp_path / "docs.jsonl", records)
    one = tmp_path / "one"
    build_index(read_json_collection(blank_corpus), one, model, codec="IVF8,PQ4", progress=False,
                model_name="aligner")
    result = torchrun("pyserini_aligner.index", "--corpus", blank_corpus, "--index", tmp_path / "dist",
                      "--codec-from", one, "--dist-timeout", "60")
    assert result.returncode == 0, result.stderr[-6000:]
    assert "not indexed: blank-1, blank-3" in result.stderr and "not indexed: blank-6, blank-9" in result.stderr
    same_index(one, tmp_path / "dist")
    assert read_manifest(tmp_path / "dist").num_empty == read_manifest(one).num_empty == 4
    assert not any(d.startswith("blank") for d in StoredIndex(tmp_path / "dist").docids)


def test_shards_of_a_large_corpus_index_its_share(tmp_path, single, corpus, monkeypatch):
    """β^d left unset comes from the whole corpus's size, not a shard's, so that the shards of a corpus of
    SCALE_DOCS documents (made small here) all index the scale share and merge."""
    from pyserini_aligner.index import options

    monkeypatch.setattr(options, "SCALE_DOCS", 20)  # 24 documents: 8 a shard
    shards = [tmp_path / f"shard_{i}" for i in range(3)]
    for i, shard in enumerate(shards):
        assert index_cli.main(["--corpus", str(corpus), "--index", str(shard), "--shard-id", str(i), "--shard-num", "3",
                               "--codec-from", str(single), "--quiet"]) == 0
    assert [read_manifest(s).doc_prune for s in shards] == [options.SCALE_DOC_PRUNE] * 3
    assert merge_cli.main(["--inputs", *map(str, shards), "--index", str(tmp_path / "merged"), "--quiet"]) == 0


def test_shards_and_merge_equal_one_process(tmp_path, single, corpus):
    shards = [tmp_path / f"shard_{i}" for i in range(3)]
    for i, shard in enumerate(shards):
        assert index_cli.main(["--corpus", str(corpus), "--index", str(shard), "--shard-id", str(i), "--shard-num", "3",
                               "--codec-from", str(single), "--quiet"]) == 0
    assert [read_manifest(s).num_docs for s in shards] == [8, 8, 8]
    assert merge_cli.main(["--inputs", *map(str, shards), "--index", str(tmp_path / "merged"), "--quiet"]) == 0
    merged = read_manifest(tmp_path / "merged")
    assert len(merged.segments) == 3 and merged.generation == 1
    same_index(single, tmp_path / "merged")
    source = read_manifest(shards[1]).segments[0]
    linked = tmp_path / "merged" / merged.segments[1].name / "token_residuals.u8"
    assert linked.stat().st_ino == (shards[1] / source.name / "token_residuals.u8").stat().st_ino  # hard link
    assert ranking(tmp_path / "merged") == ranking(single)
    # sharded search over two CPU "devices" (a worker process each) ranks like the unsharded index
    sharded = ranking(tmp_path / "merged", backend="torch", devices=["cpu", "cpu"])
    for want in (ranking(single, backend="torch"), ranking(single)):
        for got, hits in zip(sharded, want):
            assert_same_ranking(got, hits)


def test_merge_refuses_mismatches(tmp_path, model, single, corpus):
    docs = short_records(N_DOCS, words=8)
    other = tmp_path / "other"
    build_index([(d["id"] + "x", d["contents"]) for d in docs[:6]], other, model, codec="IVF8,PQ4",
                progress=False)  # its own codec
    assert re.match(r"error: .*other: field 'codec_files' .* differs from .*idx's",
                    cli_error(merge_cli.main, "--inputs", single, other, "--index", tmp_path / "m1", "--quiet"))
    pruned = tmp_path / "pruned"
    build_index([(d["id"] + "y", d["contents"]) for d in docs[:6]], pruned, model, codec_from=single,
                doc_prune=0.5, progress=False)
    with pytest.raises(ValueError, match=r"pruned: field 'doc_prune' is 0.5 but .*idx has 0.2"):
        merge_indexes([single, pruned], tmp_path / "m2", progress=False)
    again = tmp_path / "again"
    build_index([(d["id"], d["contents"]) for d in docs[3:5]], again, model, codec_from=single, progress=False)
    with pytest.raises(ValueError, match=rf"duplicate docid '{docs[3]['id']}': in .*idx and in .*again"):
        merge_indexes([single, again], tmp_path / "m3", progress=False)
    with pytest.raises(ValueError, match="must be a new folder apart from the input"):
        merge_indexes([single, again], single / "inner", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "other", "pruned"]  # nothing half-written


def test_killed_rank_leaves_no_index_and_is_named(tmp_path, single, corpus):
    target, port = tmp_path / "idx", free_port()
    command = [sys.executable, "-m", "pyserini_aligner.index", "--corpus", str(corpus), "--index", str(target),
               "--codec-from", str(single), "--dist-timeout", "60", "--quiet"]
    ranks = [subprocess.Popen(command, env=run_env(0, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True),
             subprocess.Popen(command, env=run_env(1, 2, port, PYSERINI_ALIGNER_FAULT="segment-add"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    try:
        _, err = ranks[0].communicate(timeout=90)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.communicate()
    assert ranks[1].returncode == -9  # killed at the fault point
    assert ranks[0].returncode != 0
    assert "error: rank 1 (pid" in err and "died without reporting" in err, err[-2000:]
    assert list(tmp_path.iterdir()) == []  # neither an index nor a build folder


def _exchange_rows(rank: int, world: int, group_file: str, results) -> None:
    """One Gloo rank of the all-to-all test: rank r sends rank j (r + j) rows of each kind, valued from r and j;
    what it received, or its error, goes on ``results``."""
    try:
        import torch
        import torch.distributed as dist

        from pyserini_aligner.dist import Collectives, DistContext, join_group

        ctx, created = join_group(DistContext(rank, world, rank), rendezvous=group_file, timeout_s=120)
        assert created and dist.get_backend() == "gloo"
        exchange = Collectives(ctx)
        assert not exchange.on_device  # Gloo alone: tensors through the host, the work not split
        kinds = {"int16": lambda n, v: torch.full((n,), -v, dtype=torch.int16),
                 "bool": lambda n, v: torch.arange(n) % 2 == v % 2,
                 "uint8": lambda n, v: torch.full((n, 3), v, dtype=torch.uint8),
                 "int64": lambda n, v: torch.arange(n) + (v << 40)}
        got = {name: [t.tolist() for t in exchange.all_to_all_rows([make(rank + j, 10 * rank + j)
                                                                    for j in range(world)])]
               for name, make in kinds.items()}
        known = exchange.all_to_all_rows([kinds["int64"](rank + j, 10 * rank + j) for j in range(world)],
                                         received=[j + rank for j in range(world)])  # what each sends here
        assert [t.tolist() for t in known] == got["int64"]
        results.put((rank, got))
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(err).__name__}: {err}"))


def test_all_to_all_of_varying_row_counts(tmp_path):
    """Collectives.all_to_all_rows over Gloo: parts of different row counts (none included), of types NCCL does not
    carry (int16, bool) and of several columns arrive whole, in rank order; alike when the receiver names the
    counts."""
    import torch
    import torch.multiprocessing as mp

    world = 3
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_exchange_rows, args=(rank, world, str(tmp_path / "group"), results))
                 for rank in range(world)]
    for process in processes:
        process.start()
    got = dict(results.get(timeout=300) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    for rank in range(world):
        assert not isinstance(got[rank], str), got[rank]
        for sender in range(world):
            n, v = sender + rank, 10 * sender + rank  # what sender made for this rank
            assert got[rank]["int16"][sender] == [-v] * n
            assert got[rank]["bool"][sender] == (torch.arange(n) % 2 == v % 2).tolist()
            assert got[rank]["uint8"][sender] == [[v] * 3] * n
            assert got[rank]["int64"][sender] == [i + (v << 40) for i in range(n)]
    assert got[0]["int64"][0] == []  # rank 0 sent itself nothing


def _split_search(rank: int, world: int, group_file: str, index: str, queries: list[str], results) -> None:
    """One Gloo rank searching through the path GPUs take under NCCL (``Collectives(on_device=True)``: encoding,
    candidates, centroid interaction and refinement split among the ranks, candidates fetched from the ranks that
    hold them); each query searched alone, under placement "auto", which every rank decides alike (shard: CPU ranks
    take no replica by choice). Puts (rank, the placement taken, whether the search split, the rankings) or the
    error."""
    try:
        import torch.distributed as dist

        from pyserini_aligner.dist import Collectives, DistContext, join_group
        from pyserini_aligner.search.options import SearchOptions

        ctx, _ = join_group(DistContext(rank, world, rank), rendezvous=group_file, timeout_s=120)
        options = SearchOptions(placement="auto").on_rank(ctx)
        searcher = AlignerSearcher(index, options=options.replace(exchange=Collectives(ctx, on_device=True)))
        results.put((rank, searcher.engine.placement, searcher.engine.split, [searcher.search(text, k=10) for text in queries]))
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - reported to the test
        results.put((rank, None, None, f"{type(err).__name__}: {err}"))


def test_the_split_path_of_gpus_ranks_as_one_process(tmp_path, two_segment_index, model):
    """Two Gloo ranks, a segment each, searching through the split path that NCCL ranks on GPUs take: every rank
    returns each query's ranking of one process, scores to float32 rounding; placement auto shards on CPU ranks."""
    import multiprocessing as mp

    queries = ["cancer risk of smoking", "protein folding in cells", "vitamin d deficiency and bone density",
               "antibiotic resistance of bacteria"]
    want = [AlignerSearcher(two_segment_index, encoder=model, backend="torch").search(text, k=10) for text in queries]
    world, context = 2, mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_split_search, args=(rank, world, str(tmp_path / "group"),
                                                             str(two_segment_index), queries, results))
                 for rank in range(world)]
    for process in processes:
        process.start()
    got = {rank: rest for rank, *rest in (results.get(timeout=300) for _ in processes)}
    for process in processes:
        process.join(timeout=60)
    for rank in range(world):
        placement, split, ranked = got[rank]
        assert not isinstance(ranked, str), ranked
        assert placement == "shard" and split is True
        for hits, expected in zip(ranked, want):
            assert_same_ranking([(h.docid, h.score) for h in hits], [(h.docid, h.score) for h in expected], atol=1e-5)


def test_a_rank_uses_its_local_gpu():
    """--device cuda (or any CUDA device) means cuda:LOCAL_RANK for every rank, the CPU stays the CPU."""
    from pyserini_aligner.dist import DistContext, rank_device

    ctx = DistContext(rank=5, world_size=8, local_rank=1)
    assert rank_device("cuda", ctx) == rank_device("cuda:0", ctx) == "cuda:1"
    assert rank_device("cpu", ctx) == "cpu"
