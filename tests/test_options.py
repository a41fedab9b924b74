"""SearchOptions: every search setting checked once, naming the bad field; changes checked again; picklable (worker
processes get them); the searcher takes them or its keyword arguments; the depth of a top-k search."""
from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from pyserini_aligner.alignment import Strategy
from pyserini_aligner.search import AlignerSearcher
from pyserini_aligner.search.options import (DEEP_FACTOR, FILTER_DEEPEN, FILTER_EXHAUSTIVE, Depth, SearchOptions,
                                            filtered_depth)


@pytest.mark.parametrize("changes, message", [
    ({"k_per_token": 0}, "k_per_token must be None or an integer >= 1, got 0"),
    ({"max_candidates": 2.5}, "max_candidates must be None or an integer >= 1, got 2.5"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ({"query_prune": 0.0}, r"query_prune must be in \(0, 1\], got 0.0"),
    ({"interaction_candidates": -1}, "interaction_candidates must be None or an integer >= 0, got -1"),
    ({"refine_with": "some"}, "refine_with must be one of"),
    ({"query_max_length": 2}, "query_max_length must be >= 3"),
    ({"strategy": "top-q:1"}, "strategy: bad alignment strategy 'top-q:1'"),
    ({"backend": "lucene"}, "backend must be one of"),
    ({"placement": "spread"}, "placement must be one of"),
    ({"device": "cuda:0", "backend": "faiss"}, "backend 'faiss' runs on the CPU"),
    ({"devices": ["cpu", "cpu"], "backend": "faiss"}, "several devices, segments and exchange need backend 'torch'"),
])
def test_a_bad_setting_names_its_field(changes, message):
    with pytest.raises(ValueError, match=message):
        SearchOptions(**changes)
    with pytest.raises(ValueError, match=message):
        SearchOptions().replace(**changes)


def test_options_are_typed_resolved_and_picklable():
    options = SearchOptions(strategy="top-k:2", devices=["cpu", "cpu"], segments=[0, 1], backend="torch")
    assert options.strategy == Strategy("top-k", k=2) and options.devices == ("cpu", "cpu")
    assert pickle.loads(pickle.dumps(options)) == options
    resolved = options.resolved()
    assert (resolved.k_per_token, resolved.max_candidates, resolved.interaction_candidates) == (100, 128, 0)
    assert resolved.nprobe is None and resolved.resolved() == resolved
    gpu = SearchOptions(device="cuda:1").resolved()
    assert (gpu.backend, gpu.k_per_token, gpu.max_candidates, gpu.interaction_candidates) == ("torch", 3000, 768, 49152)
    assert SearchOptions(max_candidates=7).resolved().max_candidates == 7


def test_unknown_settings_are_type_errors_naming_the_fields():
    with pytest.raises(TypeError, match="unknown search option.s. k_per_probe; the fields of SearchOptions are "
                                        "strategy, k_per_token"):
        SearchOptions().replace(k_per_probe=3)
    with pytest.raises(TypeError, match="unknown search option.s. bogus"):
        AlignerSearcher("no-index-read", bogus=1)


def test_the_depth_of_a_search():
    """K and the refined count at least DEEP_FACTOR·k, the interaction width only where wider than the refined count
    and the backend has the stage, nprobe raised to reach 2K entries, everything bounded by the live documents."""
    store = SimpleNamespace(num_live=1000, codec=object(), codec_spec=SimpleNamespace(nlist=64), num_live_kept=6400)
    options = SearchOptions(k_per_token=20, max_candidates=50, interaction_candidates=300, nprobe=2).resolved()
    assert options.depth(10, store, True) == Depth(per_probe=20, nprobe=2, interaction=300, refined=50)
    assert options.depth(10, store, False).interaction == 0
    deep = options.depth(100, store, True)
    assert deep == Depth(DEEP_FACTOR * 100, 4, 400, 200) and deep.per_probe == deep[0]
    assert options.depth(1000, store, True) == Depth(2000, 40, 0, 1000)  # 4k > live: no interaction stage
    fp16 = SimpleNamespace(num_live=30, codec=None, manifest=None)
    assert SearchOptions().resolved().depth(10, fp16, False) == Depth(100, 8, 0, 30)


def test_the_depth_of_a_filtered_search():
    """A filter matching at most FILTER_EXHAUSTIVE × the refined count: every match refined, unprobed. Otherwise the
    probes' lists grow as the matches grow rarer (live / matching times, at most FILTER_DEEPEN times and nlist), K
    stays, and the interaction stage narrows at most the matching documents; without an interaction stage a
    compressed index narrows FILTER_EXHAUSTIVE × the refined count by centroid interaction (what the rarest probed
    filter would refine unprobed) and an fp16 index refines more by the same ratio as the lists (at most
    FILTER_DEEPEN times)."""
    staged = Depth(per_probe=100, nprobe=8, interaction=3000, refined=128)
    direct = staged._replace(interaction=0)
    for depth in (staged, direct):
        assert filtered_depth(depth, 0, 10_000, 64) == Depth(0, 0, 0, 0)
        assert filtered_depth(depth, 7, 10_000, 64) == Depth(0, 0, 0, 7)
        assert filtered_depth(depth, 7, 10_000, 64).every_row
        edge = FILTER_EXHAUSTIVE * depth.refined
        assert filtered_depth(depth, edge, 10_000, 64).every_row
        assert not filtered_depth(depth, edge + 1, 10_000, 64).every_row
        assert filtered_depth(depth, 10_000, 10_000, 64) == depth  # a filter matching every document
        assert filtered_depth(depth, 1_000, 10_000, 20).nprobe == min(20, 8 * FILTER_DEEPEN)
        assert filtered_depth(depth, 1_000, 10_000, None).nprobe == 8  # fp16: no inverted lists
    assert FILTER_DEEPEN >= 2
    # with an interaction stage: the lists grow, the refined count stays, the interaction narrows the matches at most
    assert filtered_depth(staged, 5_000, 10_000, 64) == Depth(100, 16, 3000, 128)  # half: twice the lists
    assert filtered_depth(staged, 8_000, 10_000, 64) == Depth(100, 10, 3000, 128)  # rounded up
    assert filtered_depth(staged, 1_000, 10_000, 64) == Depth(100, 8 * FILTER_DEEPEN, 1000, 128)
    assert filtered_depth(staged, 1_000, 10_000, 5) == Depth(100, 5, 1000, 128)  # at most every list
    assert filtered_depth(staged._replace(interaction=100), 1_000, 10_000, 64).interaction == 0  # no wider than 128
    # without one: a compressed index narrows by centroid interaction, an fp16 index refines more
    assert filtered_depth(direct, 5_000, 10_000, 64) == Depth(100, 16, FILTER_EXHAUSTIVE * 128, 128)
    assert filtered_depth(direct, edge + 1, 10_000, 64).interaction == edge  # what the edge refines unprobed
    assert filtered_depth(direct, 1_000, 10_000, 64) == Depth(100, 8 * FILTER_DEEPEN, FILTER_EXHAUSTIVE * 128, 128)
    assert filtered_depth(direct, 5_000, 10_000, None) == Depth(100, 8, 0, 256)
    assert filtered_depth(direct, 1_000, 10_000, None) == Depth(100, 8, 0, 128 * FILTER_DEEPEN)
    store = SimpleNamespace(num_live=10_000, codec=object(), codec_spec=SimpleNamespace(nlist=64),
                            num_live_kept=640_000)
    options = SearchOptions(k_per_token=100, max_candidates=128, interaction_candidates=0, nprobe=8).resolved()
    assert options.depth(10, store, True, matching=5_000) == filtered_depth(options.depth(10, store, True), 5_000,
                                                                          10_000, 64)
    assert options.depth(10, store, True, matching=None) == options.depth(10, store, True)
