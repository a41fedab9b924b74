"""The search backends behind AlignerSearcher's seam: each one, searched to exhaustion, ranks as a loop over every
live document with the slow alignment score of tests/reference.py; several (CPU) devices rank exactly as one in both
placements, filtered searches too; the placement rules and the batch split."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pyserini_aligner.alignment import parse_strategy
from pyserini_aligner.index import StoredIndex, build_index
from pyserini_aligner.index.live import AlignerIndex
from pyserini_aligner.search import AlignerSearcher
from pyserini_aligner.search.backends import choose
from pyserini_aligner.search.backends.base import QUERY_PROBES, Queries, batch_parts
from pyserini_aligner.search.backends.faiss_cpu import FaissFlat, FaissIVF
from pyserini_aligner.search.backends.tokens import TorchTokens
from pyserini_aligner.search.backends.torch_codes import TorchCodes, codes_on, resident_bytes, room_error
from pyserini_aligner.search.backends.workers import Workers, gpu_worker_threads
from pyserini_aligner.search.candidates import merge_probes
from pyserini_aligner.search.encoding import BALANCE_WORDS, TEXT_WORDS, text_parts

import reference
from conftest import assert_same_ranking, assert_same_run
from test_index import short_records

N_DOCS = 24
QUERIES = ["protein folding in cells", "cancer risk and diet", "gene expression of neurons"]
GONE = "deleted"  # the docid of a document deleted from the compressed index


def segmented_index(folder: Path, model, codec: str, doc_prune: float | None = None) -> Path:
    """The first N_DOCS SciFact documents (8 words each) in three segments (12, 6 and 6 documents) sharing one
    codec, plus one more document in the last segment, deleted."""
    docs = [(r["id"], r["contents"]) for r in short_records(N_DOCS, words=8)]
    build_index(docs[:12], folder, model, codec=codec, progress=False, model_name="aligner", doc_prune=doc_prune)
    live = AlignerIndex(folder, encoder=model)
    live.add(docs[12:18])
    live.add(docs[18:] + [(GONE, "protein folding in cells and cancer risk")])
    live.delete([GONE])
    return folder


@pytest.fixture(scope="module")
def codes_index(tmp_path_factory, model) -> Path:
    return segmented_index(tmp_path_factory.mktemp("codes") / "idx", model, "IVF8,PQ4")


@pytest.fixture(scope="module")
def fp16_index(tmp_path_factory, model) -> Path:
    return segmented_index(tmp_path_factory.mktemp("fp16") / "idx", model, "fp16")


def half_filter(docids: list[str]) -> list[str]:
    """Every other document of the index, and the deleted one: a filter that devices and ranks resolve alike."""
    return [docid for row, docid in enumerate(docids) if row % 2 == 0 or docid == GONE]


def filtered_rankings(searcher: AlignerSearcher) -> list:
    """The rankings of :func:`half_filter` that processes are compared on: every match refined (k=3), then probed
    with the mask (one candidate refined per query)."""
    chosen = half_filter(list(searcher.docids))
    ranked = [searcher.rank(QUERIES, k=3, filter=chosen)]
    searcher.configure(max_candidates=1)
    assert not searcher.depth(1, chosen).every_row
    return ranked + [searcher.rank(QUERIES, k=1, filter=chosen)]


def exhaustive_knobs(index: Path) -> dict:
    """Knobs under which candidate generation keeps every live document: every inverted list probed, every indexed
    token taken per probe, every document refined, no interaction stage."""
    store = StoredIndex(index)
    knobs = dict(k_per_token=int(store.manifest.num_kept), max_candidates=store.num_docs, interaction_candidates=0)
    if store.codec is not None:
        knobs["nprobe"] = store.codec_spec.nlist
    return knobs


def reference_ranking(store: StoredIndex, model, text: str, k: int) -> list[tuple[str, float]]:
    """The top k live documents by reference.alignment_score of the query's real tokens against each document's
    stored (decoded) tokens, ties to the lower row."""
    out = model.encode_padded([text], is_query=True)
    q = out.vectors[0][out.mask[0]].double().tolist()
    s = parse_strategy(store.manifest.default_strategy)
    scored = []
    for row in np.flatnonzero(store.live):
        start, end = int(store.offsets[row]), int(store.offsets[row + 1])
        d = store.token_vectors(np.arange(start, end)).double().tolist()
        score = reference.alignment_score(q, [True] * len(q), d, [True] * len(d), s.kind, s.k, s.p, s.eps)
        scored.append((-score, int(row)))
    return [(store.docids[row], -negative) for negative, row in sorted(scored)[:k]]


CASES = {  # name: (index fixture, searcher arguments, the backend it opens)
    "faiss-ivf": ("codes_index", dict(backend="faiss"), FaissIVF),
    "faiss-flat": ("fp16_index", dict(backend="faiss"), FaissFlat),
    "torch-codes": ("codes_index", dict(backend="torch"), TorchCodes),
    "torch-tokens": ("fp16_index", dict(backend="torch"), TorchTokens),
    "replicated": ("codes_index", dict(backend="torch", devices=["cpu", "cpu"], placement="replicate"), Workers),
    "sharded": ("codes_index", dict(backend="torch", devices=["cpu", "cpu"], placement="shard"), Workers),
}


@pytest.mark.parametrize("case", list(CASES))
def test_backend_searched_to_exhaustion_ranks_as_the_reference(request, model, case):
    fixture, knobs, kind = CASES[case]
    index = request.getfixturevalue(fixture)
    searcher = AlignerSearcher(index, encoder=model, **knobs, **exhaustive_knobs(index))
    assert type(searcher.engine) is kind
    store = searcher.store
    assert not store.live.all()
    for text, got in zip(QUERIES, searcher.rank(QUERIES, k=5)):
        want = reference_ranking(store, model, text, 5)
        assert [d for d, _ in got] == [d for d, _ in want]
        assert np.allclose([s for _, s in got], [s for _, s in want], atol=1e-4)
        assert GONE not in {d for d, _ in got}


@pytest.mark.parametrize("count, placement", [(3, "replicate"), (2, "shard"), (3, "auto")])
def test_several_devices_rank_exactly_as_one(codes_index, model, placement, count):
    """At the default depth (interaction stage on), two or three CPU devices in either placement return the
    one-device ranking; one query at a time and batches (of two queries, split one and one across replicas: the
    third replica is left without queries) alike, scores to float32 rounding: the workers are other processes (a
    replica also encodes its part of a batch alone, and a CPU's vectors of a text can differ in the last bit with
    the batch around it). On CPU devices "auto" shards (three shards here)."""
    knobs = dict(encoder=model, backend="torch", interaction_candidates=16, max_candidates=8, k_per_token=20,
                 batch_size=2)
    one = AlignerSearcher(codes_index, **knobs)
    two = AlignerSearcher(codes_index, devices=["cpu"] * count, placement=placement, **knobs)
    assert two.engine.placement == ("shard" if placement == "auto" else placement)
    if placement != "replicate":  # consecutive segments, balanced by tokens
        assert two.engine.rows_held == ([12, 13] if count == 2 else [12, 6, 7])
    else:
        assert two.engine.rows_held == [25] * count
    for texts, k in ((QUERIES, 3), (QUERIES, 10), (QUERIES[:1], 5)):
        got, want = two.rank(texts, k=k), one.rank(texts, k=k)
        for a, b in zip(got, want):
            assert_same_ranking(a, b)
    chosen = half_filter(list(one.docids))  # sent to the workers as rows; every match refined
    for texts, k in ((QUERIES, 3), (QUERIES[:1], 5)):
        got, want = two.rank(texts, k=k, filter=chosen), one.rank(texts, k=k, filter=chosen)
        for a, b in zip(got, want, strict=True):
            assert_same_ranking(a, b)
            assert {d for d, _ in a} <= set(chosen) - {GONE}


def test_staged_backends_probe_alike(codes_index, model):
    """FAISS's probe and the torch engine's (one device, and two shards merged) find the same entries (which of
    several entries tied at the K-th score is kept may differ)."""
    probes = torch.nn.functional.normalize(torch.randn(6, model.config.dim, generator=torch.Generator()
                                                       .manual_seed(0)), dim=-1)
    engines = [AlignerSearcher(codes_index, encoder=model, **knobs).engine
               for knobs in (dict(backend="faiss"), dict(backend="torch"))]
    found = [engine.probe(probes, 10, 4) for engine in engines]
    store, scoring = StoredIndex(codes_index), engines[1].scoring
    found.append(merge_probes([codes_on(store, numbers, "cpu", scoring).probe(probes, 10, 4)
                               for numbers in ([0], [1, 2])], 10))
    for scores, rows in found[1:]:
        assert np.allclose(scores.numpy(), found[0][0].numpy(), atol=1e-5)
        for p in range(len(probes)):
            last = float(scores[p, -1]) + 1e-5
            mine = sorted(int(r) for r, score in zip(rows[p], scores[p]) if score > last)
            assert mine == sorted(int(r) for r, score in zip(found[0][1][p], found[0][0][p]) if score > last)


def test_reopen_chooses_again(codes_index, model, tmp_path):
    """A new generation is opened with a new backend of the same placement."""
    import shutil

    folder = tmp_path / "idx"
    shutil.copytree(codes_index, folder)
    searcher = AlignerSearcher(folder, encoder=model, backend="torch", devices=["cpu", "cpu"], placement="replicate")
    before = searcher.engine
    AlignerIndex(folder, encoder=model).add([("new", "gene expression of neurons in the brain")])
    assert searcher.reopen()
    assert searcher.engine is not before and type(searcher.engine) is Workers
    assert not before._finalizer.alive  # the last generation's workers are stopped
    assert "new" in {d for hits in searcher.rank(QUERIES, k=N_DOCS) for d, _ in hits}


def test_a_lost_worker_is_reported_and_the_searcher_opens_again(codes_index, model):
    """A worker process that dies (killed here) makes the next search fail with one line naming its device and
    stops the other workers; a searcher opened again serves the same ranking."""
    searcher = AlignerSearcher(codes_index, encoder=model, backend="torch", devices=["cpu", "cpu"],
                               placement="replicate")
    want = searcher.rank(QUERIES, k=5)
    searcher.engine.processes[0].kill()
    searcher.engine.processes[0].join()
    with pytest.raises(RuntimeError, match=r"search worker on cpu: exited with code -9"):
        searcher.rank(QUERIES, k=5)
    assert not any(process.is_alive() for process in searcher.engine.processes)
    with pytest.raises(RuntimeError, match="the search workers were stopped"):
        searcher.rank(QUERIES, k=5)
    again = AlignerSearcher(codes_index, encoder=model, backend="torch", devices=["cpu", "cpu"],
                            placement="replicate")
    for got, hits in zip(again.rank(QUERIES, k=5), want):  # other worker processes: scores to float32 rounding
        assert_same_ranking(got, hits)


def test_command_line_on_two_devices_writes_the_one_device_run(codes_index, tmp_path, capsys):
    """python -m pyserini_aligner.search --devices cpu cpu --placement replicate|shard writes the run of one
    device: the same rankings, scores to float32 rounding (the workers are other processes, and replicas encode
    their own part of a batch); --devices with --distributed is refused in one line."""
    from pyserini_aligner.search import __main__ as search_cli

    topics = tmp_path / "topics.tsv"
    topics.write_text("".join(f"q{i}\t{text}\n" for i, text in enumerate(QUERIES)))
    common = ["--index", str(codes_index), "--topics", str(topics), "--backend", "torch", "--hits", "5", "--quiet"]
    assert search_cli.main([*common, "--output", str(tmp_path / "one.trec")]) == 0
    for placement in ("replicate", "shard"):
        output = tmp_path / f"{placement}.trec"
        assert search_cli.main([*common, "--output", str(output), "--devices", "cpu", "cpu",
                                "--placement", placement]) == 0
        assert_same_run(output, tmp_path / "one.trec")
    capsys.readouterr()
    assert search_cli.main([*common, "--output", str(tmp_path / "x.trec"), "--devices", "cpu", "cpu",
                            "--distributed"]) == 2
    assert "--distributed searches on one device a rank" in capsys.readouterr().err


def test_placement_errors(codes_index, fp16_index, model):
    with pytest.raises(ValueError, match="placement must be one of"):
        AlignerSearcher(codes_index, encoder=model, backend="torch", devices=["cpu", "cpu"], placement="spread")
    with pytest.raises(ValueError, match="several devices, segments and exchange need backend 'torch'"):
        AlignerSearcher(codes_index, encoder=model, backend="faiss", devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="several devices, segments and nprobe need a compressed index"):
        AlignerSearcher(fp16_index, encoder=model, backend="torch", devices=["cpu", "cpu"])


def test_too_few_segments_for_the_devices_search_on_one(tmp_path, model):
    """An index of one segment cannot be sharded: it is searched on one device."""
    folder = tmp_path / "one"
    build_index([(r["id"], r["contents"]) for r in short_records(8, words=8)], folder, model, codec="IVF4,PQ4",
                progress=False, model_name="aligner")
    searcher = AlignerSearcher(folder, encoder=model, backend="torch", devices=["cpu", "cpu"], placement="shard")
    assert type(searcher.engine) is TorchCodes


def test_text_parts_split_in_order_by_load():
    long = " ".join(["w"] * (2 * BALANCE_WORDS))  # counted as BALANCE_WORDS words
    texts = [long, "a", "a", "a", long, long, "a"]
    parts = text_parts(texts, 3)
    assert parts[0].start == 0 and parts[-1].stop == 7
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    loads = [sum(TEXT_WORDS + min(len(t.split()), BALANCE_WORDS) for t in texts[part]) for part in parts]
    assert [p.stop - p.start for p in parts] == [3, 2, 2]
    assert max(loads) - min(loads) <= TEXT_WORDS + BALANCE_WORDS  # one text's load
    assert [p.stop - p.start for p in text_parts(["a b c"] * 9 + ["a"] * 3, 3)] == [4, 4, 4]  # mostly by count
    assert [p.stop - p.start for p in text_parts(texts[:1], 3)] == [1, 0, 0]


def test_gpu_workers_share_the_cores():
    cores = len(os.sched_getaffinity(0))
    assert gpu_worker_threads(1) == cores
    assert gpu_worker_threads(2) == max(1, cores // 2)
    assert gpu_worker_threads(cores + 1) == 1


def test_batch_parts_split_in_order_by_probes():
    width = 3 * QUERY_PROBES
    mask = torch.zeros(7, width, dtype=torch.bool)
    for row, probes in enumerate([width, 1, 1, 1, width, width, 1]):  # a long query weighs about four short ones
        mask[row, :probes] = True
    queries = Queries(torch.zeros(7, width, 2), mask, torch.zeros(7, width), mask, False)
    parts = batch_parts(queries, 3)
    assert parts[0].start == 0 and parts[-1].stop == 7
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    assert [p.stop - p.start for p in parts] == [3, 2, 2]
    loads = [int(mask[part].sum()) + QUERY_PROBES * (part.stop - part.start) for part in parts]
    assert max(loads) - min(loads) <= width + QUERY_PROBES  # one query's load
    assert [p.stop - p.start for p in batch_parts(queries.part(slice(0, 1)), 3)] == [1, 0, 0]


def test_resident_bytes_counts_the_codes(codes_index):
    """The estimate behind placement "auto" counts every token, list entry and document of the index; a GPU that
    can't hold a shard's codes gets a one-line error naming the index, the sizes and the ways out."""
    store = StoredIndex(codes_index)
    spec = store.codec_spec
    every = range(len(store.segments))
    got = resident_bytes(store, every, "all", torch.device("cpu"))
    tokens, docs, entries = store.manifest.num_tokens, store.num_docs, store.manifest.num_kept
    assert got >= tokens * (2 + spec.residual_m) + entries * (4 + spec.pq_m) + docs * 16
    assert resident_bytes(store, [0], "all", torch.device("cpu")) < got
    assert not choose.fits_whole(store, torch.device("cpu"), "all")  # only GPUs take a replica by choice
    gpu = torch.device("cuda", 0)  # a device name: nothing is placed on it
    need = resident_bytes(store, every, "all", gpu)
    assert room_error(store, every, "all", gpu, need) is None
    error = room_error(store, every, "all", gpu, need - 1)
    assert error.startswith(f"{store.index_dir}: the codes of {len(store.segments)} of its ") and "\n" not in error
    assert "free on cuda:0" in error and "--devices" in error and "--max-bytes-per-token" in error


def _split_rank(rank: int, world: int, index: str, knobs: dict, group_file: str, results) -> None:
    """One rank of a Gloo shard group whose ranks split the queries after choosing candidates (as on GPUs): its
    rankings, or its error, put on ``results``."""
    try:
        import torch.distributed as dist

        from pyserini_aligner.dist import Collectives, DistContext, join_group

        join_group(DistContext(rank, world, rank), rendezvous=group_file, timeout_s=300)
        searcher = AlignerSearcher(index, placement="shard", exchange=Collectives(DistContext(rank, world, rank)),
                                   **knobs)
        searcher.engine.split = True
        ranked = [searcher.rank(QUERIES, k=k) for k in (3, 10)] + [searcher.rank(QUERIES[:1], k=5)]
        ranked += filtered_rankings(searcher)  # each rank resolves the filter itself
        results.put((rank, ranked, searcher.engine._holders))
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(err).__name__}: {err}", None))


def test_shards_splitting_the_queries_rank_as_one(codes_index, model, tmp_path):
    """Ranks that fetch their queries' candidates from the shards holding them and score them themselves (the GPU
    path, forced here over Gloo) return the one-device ranking on every rank: batches of three queries over two
    ranks (one holding one segment, the other two), one query (the other rank scores nothing), the interaction stage
    on (more than two ranks exchanging rows: tests/test_distributed.py). A rank computes its queries' tables over
    its part of the batch, and a CPU's products can differ in the last bit with the rows around them, so scores
    agree to float32 rounding. Filtered searches (every match refined, and probed with the mask) too."""
    import torch.multiprocessing as mp

    world = 2
    knobs = dict(encoder=model, backend="torch", interaction_candidates=16, max_candidates=8, k_per_token=20,
                 batch_size=3)
    one = AlignerSearcher(codes_index, **knobs)
    want = [one.rank(QUERIES, k=k) for k in (3, 10)] + [one.rank(QUERIES[:1], k=5)] + filtered_rankings(one)
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_split_rank, args=(rank, world, str(codes_index), knobs,
                                                           str(tmp_path / "group"), results)) for rank in range(world)]
    for process in processes:
        process.start()
    got = sorted(results.get(timeout=600) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    for rank, ranked, holders in got:
        assert not isinstance(ranked, str), ranked
        assert len(holders) == world  # every rank holds segments: the queries were split
        for got_run, want_run in zip(ranked, want, strict=True):
            for a, b in zip(got_run, want_run, strict=True):
                assert_same_ranking(a, b)


@pytest.mark.parametrize("loaded", [1 << 21, 1])
def test_faiss_probe_reads_the_lists_by_parts_as_a_whole_index(codes_index, model, monkeypatch, loaded):
    """FaissIVF hands FAISS only the lists that each part of the probes scans (one probe a part with ``loaded`` 1),
    read from the segments' files, or every list once when the index holds at most ``loaded`` entries: every probe
    finds the entries, in the order, of FAISS's search of one index holding every segment's lists, deleted documents
    skipped; read by parts, no entry stays loaded afterwards."""
    import faiss

    from pyserini_aligner.search.allowed import allowed_rows, row_selector
    from pyserini_aligner.search.backends import faiss_cpu

    monkeypatch.setattr(faiss_cpu, "LOADED_ENTRIES", loaded)
    engine = AlignerSearcher(codes_index, encoder=model, backend="faiss").engine
    store = engine.store
    assert len(store.segments) == 3 and not store.live.all()
    whole = store.codec.faiss_index([(seg.ivf_offsets, np.asarray(seg.ivf_docs, np.int64) + base, seg.ivf_codes)
                                     for seg, base in zip(store.segments, store.row_base)])
    probes = torch.nn.functional.normalize(torch.randn(12, model.config.dim, generator=torch.Generator()
                                                       .manual_seed(1)), dim=-1)
    for per_token, nprobe in ((3, 1), (20, 2), (200, store.codec_spec.nlist)):
        scores, rows = engine.probe(probes, per_token, nprobe)
        params = faiss.SearchParametersIVF(nprobe=nprobe, sel=row_selector(allowed_rows(store)))
        want_scores, want_rows = whole.search(probes.numpy(), per_token, params=params)
        assert np.array_equal(rows.numpy(), want_rows) and np.array_equal(scores.numpy(), want_scores)
    kept = whole.ntotal if whole.ntotal <= loaded else 0  # a small index stays loaded; parts are released
    assert engine.index.ntotal == engine.index.invlists.compute_ntotal() == kept
    assert engine.codes._pool._max_workers == min(3, os.cpu_count())  # segments scored a thread a core at most


@pytest.mark.parametrize("which", ["codes_index", "fp16_index"])
def test_live_kept_count_skips_the_deleted_documents_tokens(request, which):
    """num_live_kept (the entries a search can return, which size nprobe) counts the kept tokens of the live
    documents, as a flag per token gives it."""
    store = StoredIndex(request.getfixturevalue(which))
    live_tokens = np.repeat(store.live, store.lengths)
    assert not store.live.all() and store.num_live_kept == int(store.kept[live_tokens].sum()) < store.manifest.num_kept


@pytest.mark.parametrize("refine_with", ["all", "kept"])
def test_packed_maxsim_refinement_of_fp16_tokens_equals_the_padded_scores(fp16_index, refine_with, monkeypatch):
    """Top-k:1 refinement of an fp16 index multiplies the candidates' tokens packed one after another (blocks that
    split documents, here 37 tokens) and takes each document's maximum: the scores of the padded alignment score,
    over three segments, invalid candidates −inf."""
    from pyserini_aligner.alignment import alignment_scores
    from pyserini_aligner.strategy import MAXSIM
    from pyserini_aligner.search.backends import faiss_cpu
    from pyserini_aligner.search.backends.base import Scoring

    store = StoredIndex(fp16_index)
    monkeypatch.setattr(faiss_cpu, "PACKED_TOKENS", 37)
    backend = FaissFlat(store, Scoring(MAXSIM, refine_with, False, 1.0, int(store.lengths.max())), None, None, 10)
    generator = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(3, 7, store.manifest.dim, generator=generator), dim=-1)
    q_mask = torch.arange(7) < torch.tensor([[7], [4], [1]])
    rows = torch.randint(0, store.num_docs, (3, 10), generator=generator)
    valid = torch.rand(3, 10, generator=generator) < 0.8
    scores = backend.refine(q, q_mask, None, rows, valid)
    assert torch.isneginf(scores[~valid]).all()
    for b in range(3):
        d, d_mask, _ = store.gather(rows[b][valid[b]].numpy(), kept_only=refine_with == "kept")
        expected = alignment_scores(q[b:b + 1], q_mask[b:b + 1], d, d_mask, MAXSIM)[0]
        torch.testing.assert_close(scores[b][valid[b]], expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("refine_with", ["all", "kept"])
@pytest.mark.parametrize("spec", ["top-k:3", "top-k:1000", "top-p:0.3", "top-p:0.001"])
def test_packed_top_k_and_top_p_refinement_equals_the_padded_scores(fp16_index, refine_with, spec, monkeypatch):
    """Top-k and top-p refinement of an fp16 index multiplies blocks of whole documents (here about 37 tokens:
    most blocks one document, some several) laid out only as wide as the block's longest: the padded alignment
    score's values, over three segments, with k past every document's length and p below one token."""
    from pyserini_aligner.alignment import alignment_scores
    from pyserini_aligner.search.backends import faiss_cpu
    from pyserini_aligner.search.backends.base import Scoring
    from pyserini_aligner.strategy import parse_strategy

    strategy = parse_strategy(spec)
    store = StoredIndex(fp16_index)
    monkeypatch.setattr(faiss_cpu, "PACKED_TOKENS", 37)
    backend = FaissFlat(store, Scoring(strategy, refine_with, False, 1.0, int(store.lengths.max())), None, None, 10)
    generator = torch.Generator().manual_seed(1)
    q = torch.nn.functional.normalize(torch.randn(3, 7, store.manifest.dim, generator=generator), dim=-1)
    q_mask = torch.arange(7) < torch.tensor([[7], [4], [1]])
    rows = torch.randint(0, store.num_docs, (3, 12), generator=generator)
    valid = torch.rand(3, 12, generator=generator) < 0.8
    scores = backend.refine(q, q_mask, None, rows, valid)
    assert torch.isneginf(scores[~valid]).all()
    for b in range(3):
        d, d_mask, _ = store.gather(rows[b][valid[b]].numpy(), kept_only=refine_with == "kept")
        expected = alignment_scores(q[b:b + 1], q_mask[b:b + 1], d, d_mask, strategy)[0]
        torch.testing.assert_close(scores[b][valid[b]], expected, atol=1e-6, rtol=1e-6)


def test_document_blocks_hold_whole_documents():
    from pyserini_aligner.search.backends.faiss_cpu import document_blocks

    lengths = np.array([3, 0, 5, 9, 2, 2, 0])
    assert document_blocks(lengths, 8) == [(0, 3), (3, 4), (4, 7)]
    assert document_blocks(lengths, 100) == [(0, 7)]
    assert document_blocks(np.array([], dtype=int), 8) == []


def test_every_document_of_a_flat_index_of_all_tokens_is_scored(tmp_path, model, fp16_index, monkeypatch):
    """An fp16 index of every token (β^d = 1) searched with top-k:1 and every query token scores every live
    document (blocks of about 40 products here, over three segments): the reference ranking at the searcher's own
    depth, filtered or not; with β^q < 1 it searches through the candidates."""
    from pyserini_aligner.search.backends import faiss_cpu

    index = segmented_index(tmp_path / "idx", model, "fp16", doc_prune=1.0)
    monkeypatch.setattr(faiss_cpu, "EXHAUSTIVE_ELEMENTS", 40)
    searcher = AlignerSearcher(index, encoder=model, backend="faiss", max_candidates=1, query_prune=1.0)
    assert searcher.engine.scores_every_document
    assert not AlignerSearcher(fp16_index, encoder=model, backend="faiss").engine.scores_every_document  # β^d < 1
    store = searcher.store
    for text, got in zip(QUERIES, searcher.rank(QUERIES, k=5)):
        want = reference_ranking(store, model, text, 5)
        assert [d for d, _ in got] == [d for d, _ in want] and GONE not in {d for d, _ in got}
        assert np.allclose([s for _, s in got], [s for _, s in want], atol=1e-5)
    chosen = half_filter(list(searcher.docids))
    for text, got in zip(QUERIES, searcher.rank(QUERIES, k=30, filter=chosen)):
        want = [(d, s) for d, s in reference_ranking(store, model, text, N_DOCS) if d in chosen]
        assert [d for d, _ in got] == [d for d, _ in want]
    monkeypatch.setattr(FaissFlat, "exhaustive", lambda *args: pytest.fail("β^q < 1 scored every document"))
    pruned = AlignerSearcher(index, encoder=model, backend="faiss", query_prune=0.5)
    assert all(len(hits) == 3 for hits in pruned.rank(QUERIES, k=3))
