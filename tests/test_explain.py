"""AligneR explain view on the shared default index of 200 SciFact documents with the real model: explanations match
the searcher, HTML structure and escaping, PNG heat map, CLI, and the page rendered in a real headless chromium."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pyserini_aligner.explain import explain, explain_document, render_html, render_png
from pyserini_aligner.explain import __main__ as cli
from pyserini_aligner.index import read_json_collection
from pyserini_aligner.model import AlignerModel
from pyserini_aligner.search import AlignerSearcher
from pyserini_aligner.strategy import parse_strategy

from conftest import cli_error

QUERY = "diffusion tensor imaging of white matter in newborn brains"
STRATEGY = parse_strategy("top-k:2")
TOP_P = parse_strategy("top-p:0.02")


@pytest.fixture(scope="module")
def corpus(corpus_file) -> Path:
    """The 200 SciFact documents of the shared indexes (JsonCollection, contents = title + text)."""
    return corpus_file


@pytest.fixture(scope="module")
def explanations(default_index, corpus):
    return explain(default_index, QUERY, hits=2, strategy=STRATEGY, corpus=corpus)


def doc_text(corpus: Path, docid: str) -> str:
    return next(text for d, text, *_ in read_json_collection(corpus) if d == docid)


def test_explanations_match_the_searcher(explanations, default_index, model):
    hits = AlignerSearcher(default_index, encoder=model, strategy=STRATEGY).search(QUERY, k=2)
    assert [e.docid for e in explanations] == [h.docid for h in hits]
    assert [e.rank for e in explanations] == [1, 2]
    np.testing.assert_allclose([e.score for e in explanations], [h.score for h in hits], rtol=1e-5)
    for e in explanations:
        n, m = e.sim.shape
        assert (len(e.q_tokens), len(e.d_tokens)) == (n, m) == e.align.shape
        assert e.strategy == str(STRATEGY) and not e.use_salience  # the default checkpoint scores without salience
        np.testing.assert_array_equal(e.align.sum(1), 2.0)  # top-k:2: two aligned doc tokens per query token
        assert e.contribution.sum() == pytest.approx(e.score, rel=1e-5)
        np.testing.assert_allclose(e.q_weight, e.sim.max(1), rtol=1e-6)
        assert e.q_tokens[0].special and e.q_tokens[0].text == "[CLS]"
        assert "".join(t.text if t.glue else " " + t.text for t in e.q_tokens[1:-1]).strip() == QUERY


def test_html_structure(explanations):
    page = render_html(explanations, top_query=5)
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page.lower()
    assert not re.search(r"""(src|href)\s*=|url\(|@import""", page)  # no external assets
    assert page.count('class="card doc"') == 2
    for word in QUERY.split():
        assert re.search(rf'<span class="tok[^"]*"[^>]*>{word}</span>', page), word
    assert "use_salience = false" in page and "max sim" in page
    assert str(STRATEGY) in page and f"{explanations[0].score:.4f}" in page
    cards = page.split('class="card doc"')[1:]
    for card in cards:
        doc_part = card.split('class="tokens document"')[1]
        assert 'class="tok aligned"' in doc_part and '<sup class="mark"' in doc_part
        assert card.count("<tr>") == 1 + 5  # header + the 5 most salient query tokens
        assert card.count('class="chip"') >= 5  # their aligned doc tokens with similarities


def test_query_is_escaped(default_index, corpus):
    query = '<script>alert("x")</script> white matter & newborn <b>brains</b>'
    docid = explain(default_index, QUERY, hits=1, corpus=corpus)[0].docid
    (ex,) = explain(default_index, query, docids=[docid], strategy=STRATEGY, corpus=corpus)
    assert ex.rank is None and ex.docid == docid
    page = render_html([ex])
    assert "<script" not in page.lower()
    assert ("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; white matter &amp; newborn "
            "&lt;b&gt;brains&lt;/b&gt;") in page
    assert '<span class="tok' in page and "&lt;</span>" in page  # the "<" token itself, escaped


def test_missing_or_wrong_corpus(default_index, corpus, model, explanations):
    with pytest.raises(ValueError, match=r"records no corpus.*--corpus"):
        explain(default_index, QUERY)
    assert "--corpus" in cli_error(cli.main, "--index", default_index, "--query", QUERY)
    with pytest.raises(ValueError, match="no document with id 'nope'"):
        explain(default_index, QUERY, docids=["nope"], corpus=corpus)
    ex = explanations[0]
    other = next(d for d, *_ in read_json_collection(corpus) if d != ex.docid)
    from pyserini_aligner.index import StoredIndex

    store = StoredIndex(default_index)
    row = store.row_of(ex.docid)
    positions = np.arange(store.offsets[row], store.offsets[row + 1])
    vectors = store.token_vectors(positions).numpy()
    salience = store.token_salience(positions)
    with pytest.raises(ValueError, match="differ"):
        explain_document(model, QUERY, doc_text(corpus, other), vectors, salience, STRATEGY, docid=ex.docid)


def test_salience_model_shades_by_salience(corpus):
    model = AlignerModel.from_pretrained("aligner")
    model.config.use_salience = model.config.salience_in_score = True
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for head in (model.q_salience, model.d_salience):
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * 0.1)
    text = doc_text(corpus, "4983")
    stored = model.encode([text], is_query=False)[0]
    ex = explain_document(model, QUERY, text, stored.vectors.astype(np.float16), stored.salience, TOP_P,
                          docid="4983")
    q_sal = model.encode([QUERY], is_query=True)[0].salience
    np.testing.assert_allclose(ex.q_weight, q_sal, rtol=1e-6)
    np.testing.assert_allclose(ex.d_weight, stored.salience, rtol=1e-6)
    assert ex.contribution.sum() == pytest.approx(ex.score, rel=1e-4)
    page = render_html([ex])
    assert "use_salience = false" not in page and "unary salience u" in page and "top-p:0.02" in page
    rows = page.split('<table class="align">')[1].split("</table>")[0].count("<tr>") - 1
    assert rows == min(8, int((q_sal[1:-1] > 0).sum()))  # only query tokens with salience > 0 are listed


def test_cli_writes_html_and_png(default_index, corpus, tmp_path, capsys):
    html_path, png_path = tmp_path / "explain.html", tmp_path / "explain.png"
    assert cli.main(["--index", str(default_index), "--query", QUERY, "--corpus", str(corpus), "--hits", "2",
                     "--strategy", str(STRATEGY), "--output", str(html_path), "--png", str(png_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    page = html_path.read_text(encoding="utf-8")
    assert page.count('class="card doc"') == 2 and 'class="tok aligned"' in page
    with Image.open(png_path) as image:
        assert image.format == "PNG" and image.width > 600 and image.height > 400
        rgb = np.asarray(image.convert("RGB"))
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 200


def test_png_of_long_document_shows_most_aligned_columns(explanations, tmp_path):
    path = tmp_path / "heat.png"
    render_png(explanations[:1], path, max_cols=30)
    with Image.open(path) as image:
        assert image.width < 1400  # 30 columns, not the document's full length


def test_page_renders_in_headless_chromium(explanations, tmp_path):
    browser = shutil.which("chromium")
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed but CI is set: install the Debian package 'chromium'")
        pytest.skip("chromium is not installed (apt-get install chromium); set CI to make this a failure")
    page = tmp_path / "explain.html"
    page.write_text(render_html(explanations), encoding="utf-8")
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,1600",
                    page.as_uri()], check=True, capture_output=True, timeout=60)
    with Image.open(shot) as image:
        rgb = np.asarray(image.convert("RGB")).astype(int)
    assert rgb.shape[:2] == (1600, 1200)
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 300  # text, shading, outlines: not a blank page
    amber = (rgb[..., 0] > 240) & (rgb[..., 1] > 150) & (rgb[..., 1] < 215) & (rgb[..., 2] < 120)
    assert amber.sum() > 2000  # salience shading is drawn
    blue_mark = (abs(rgb[..., 0] - 0x1F) < 20) & (abs(rgb[..., 1] - 0x63) < 20) & (abs(rgb[..., 2] - 0xC6) < 20)
    assert blue_mark.sum() > 50  # the first query token's badge and outlines
