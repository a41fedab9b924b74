"""The codec studies: a FAISS residual codec decodes to its nearest codewords, a passage keeps its most salient
tokens as a loop picks them, and the studies run on CPU over real SciFact passages with the real model."""
import json
import math
import os
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch

from eval.experiments import codec_fidelity, residual_quantizers, token_precision

SCIFACT = Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip"


def test_a_product_quantizer_decodes_each_part_to_its_nearest_codeword():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((600, 8)).astype(np.float32)
    index = residual_quantizers.train_quantizer("PQ2x4", x)
    decoded = residual_quantizers.code_residuals(index, x[:50])
    books = faiss.vector_to_array(faiss.downcast_index(index).pq.centroids).reshape(2, 16, 4)
    for row, got in zip(x[:50], decoded):
        for part in range(2):
            sub = row[4 * part:4 * part + 4]
            nearest = books[part][np.argmin(((books[part] - sub) ** 2).sum(1))]
            assert np.allclose(got[4 * part:4 * part + 4], nearest, atol=1e-6)
    assert index.sa_code_size() == 1


def test_both_codec_studies_run_on_cpu(tmp_path):
    common = ["--beir-zip", str(SCIFACT), "--size", "16", "--device", "cpu", "--max-queries", "4", "--train-size",
              "512", "--quiet"]  # 16 passages: about 4,000 tokens; codebooks of 256 codewords trained on 512
    residual_quantizers.main(common + ["--quantizers", "PQ4", "PQ16", "--output", str(tmp_path / "rq.json")])
    report = json.loads((tmp_path / "rq.json").read_text())
    assert report["passages"] == 16 and report["queries"] == 4 and report["residual_norm2"] > 0
    coarse, fine = report["quantizers"]
    assert (coarse["bytes_per_token"], fine["bytes_per_token"]) == (6, 18)
    assert fine["squared_error"] < coarse["squared_error"] < report["residual_norm2"]
    assert all(0.0 <= row["overlap@10"] <= 1.0 for row in report["quantizers"])
    codec_fidelity.main(common + ["--codecs", "IVF64,PQ4", "IVF64,PQ4,Refine(PQ16)", "--output",
                                  str(tmp_path / "codecs.json")])
    rows = json.loads((tmp_path / "codecs.json").read_text())["codecs"]
    assert [row["bytes_per_token"] for row in rows] == [6, 18]
    assert rows[1]["squared_error"] < rows[0]["squared_error"]


def test_token_precision_plans_and_kept_tokens_against_loops():
    assert token_precision.parse_plan("PQ16") == (1.0, 16, 16, 1.0, "")
    assert token_precision.parse_plan("keep0.5:fp16") == (0.5, -1, -1, 1.0, "")
    assert token_precision.parse_plan("keep.7:PQ32/PQ0:0.25:both") == (0.7, 32, 0, 0.25, "both")
    for bad in ("PQ12", "PQ32/PQ8:1.5:error", "keep0:PQ8", "PQ32/PQ8:0.2:size", "fp32"):
        with pytest.raises(ValueError, match="bad plan"):
            token_precision.parse_plan(bad)
    lengths = torch.tensor([3, 1, 5, 2])
    salience = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.2, 0.8, 0.7, 0.4, 0.6, 0.0, 1.0])
    got = token_precision.kept_stand_ins(0.5, salience, lengths).tolist()
    want, start = [], 0
    for length in lengths.tolist():
        span = list(range(start, start + length))
        ranked = sorted(span, key=lambda t: -float(salience[t]))
        kept = set(ranked[:math.ceil(0.5 * length)])
        want += [t if t in kept else ranked[0] for t in span]
        start += length
    assert got == want


def test_token_precision_runs_on_cpu(tmp_path):
    common = ["--beir-zip", str(SCIFACT), "--size", "16", "--device", "cpu", "--max-queries", "4", "--train-size",
              "512", "--quiet"]  # 16 passages: about 4,000 tokens; codebooks of 256 codewords trained on 512
    token_precision.main(common + ["--plans", "fp16", "keep0.5:fp16", "PQ4", "PQ16/PQ0:0.5:error",
                                   "--output", str(tmp_path / "tp.json")])
    report = json.loads((tmp_path / "tp.json").read_text())
    rows = {(row["plan"], row["unit_length"]): row for row in report["plans"]}
    assert set(rows) == {("fp16", False), ("keep0.5:fp16", False), ("PQ4", False), ("PQ4", True),
                         ("PQ16/PQ0:0.5:error", False), ("PQ16/PQ0:0.5:error", True)}
    assert rows["fp16", False]["overlap@10"] == 1.0 and rows["fp16", False]["squared_error"] == 0.0
    assert 0.5 <= rows["keep0.5:fp16", False]["kept"] < 0.6
    assert rows["PQ4", False]["bytes_per_token"] == 6
    assert rows["PQ16/PQ0:0.5:error", False]["bytes_per_token"] == pytest.approx(2 + 16 * 0.5, abs=0.05)
    assert rows["PQ4", True]["squared_error"] > 0 and 0.0 <= rows["PQ4", True]["overlap@10"] <= 1.0

