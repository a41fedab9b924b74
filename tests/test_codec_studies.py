"""The codec studies: a FAISS residual codec decodes to its nearest codewords, and both studies run on CPU over
real SciFact passages with the real model."""
import json
import os
from pathlib import Path

import faiss
import numpy as np

from eval.experiments import codec_fidelity, residual_quantizers

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
    common = ["--beir-zip", str(SCIFACT), "--size", "40", "--device", "cpu", "--max-queries", "4", "--quiet"]
    residual_quantizers.main(common + ["--quantizers", "PQ4", "PQ16", "--output", str(tmp_path / "rq.json")])
    report = json.loads((tmp_path / "rq.json").read_text())
    assert report["passages"] == 40 and report["queries"] == 4 and report["residual_norm2"] > 0
    coarse, fine = report["quantizers"]
    assert (coarse["bytes_per_token"], fine["bytes_per_token"]) == (6, 18)
    assert fine["squared_error"] < coarse["squared_error"] < report["residual_norm2"]
    assert all(0.0 <= row["overlap@10"] <= 1.0 for row in report["quantizers"])
    codec_fidelity.main(common + ["--codecs", "IVF64,PQ4", "IVF64,PQ4,Refine(PQ16)", "--output",
                                  str(tmp_path / "codecs.json")])
    rows = json.loads((tmp_path / "codecs.json").read_text())["codecs"]
    assert [row["bytes_per_token"] for row in rows] == [6, 18]
    assert rows[1]["squared_error"] < rows[0]["squared_error"]
