"""Pure rendering of AligneR explanations: tokens + saliences + alignment → a self-contained HTML page or a PNG.

Nothing here touches a model or an index; :class:`Explanation` carries everything the page shows. The HTML has
inline CSS only (no scripts, no external assets); every text is escaped with :func:`html.escape`.
"""
from __future__ import annotations

import html
import os
from dataclasses import dataclass

import numpy as np

ALIGN_MIN = 0.05  # Ã entries below this (soft "da" alignments) are not shown as aligned
PALETTE = ("#1f63c6", "#d62728", "#13915f", "#8e44c9", "#b5651d", "#d6337f", "#0f9fb5", "#556070")
SHADE_RGB = (255, 166, 0)  # amber; alpha grows with salience


@dataclass(frozen=True)
class Token:
    """One model token as shown: ``text`` (its span of the original text, or the wordpiece), ``glue`` (no space
    before it: a word continuation), ``special`` ([CLS]/[SEP]) and ``piece`` (the wordpiece itself)."""

    text: str
    glue: bool
    special: bool
    piece: str


@dataclass
class Explanation:
    """Why one document scored what it did for one query.

    q_tokens [n] / d_tokens [m] are the tokens behind the query/doc vectors; sim [n, m] = Q·Dᵀ; align [n, m] = Ã of
    ``strategy``; q_weight [n] / d_weight [m] shade the tokens: unary salience u when ``use_salience``, else each
    token's max similarity to any token of the other side. contribution [n]: each query token's share of the score,
    Σ_j A_ij S_ij / Σ A (sums to ``score``).
    """

    query: str
    docid: str
    rank: int | None
    score: float
    strategy: str
    use_salience: bool
    q_tokens: list[Token]
    d_tokens: list[Token]
    q_weight: np.ndarray
    d_weight: np.ndarray
    sim: np.ndarray
    align: np.ndarray
    contribution: np.ndarray
    truncated: bool = False  # the document was cut at the model's doc_maxlen
    query_truncated: bool = False  # the query was cut at the model's query_maxlen


def top_query_tokens(ex: Explanation, count: int) -> list[int]:
    """Positions of the ``count`` most salient real (non-special) query tokens, most salient first (ties: position);
    with salience, tokens of salience 0 (which take no part in the score) are left out."""
    real = [i for i, tok in enumerate(ex.q_tokens) if not tok.special] or list(range(len(ex.q_tokens)))
    if ex.use_salience:
        real = [i for i in real if ex.q_weight[i] > 0]
    return sorted(real, key=lambda i: (-float(ex.q_weight[i]), i))[:count]


def aligned_doc_tokens(ex: Explanation, i: int) -> list[int]:
    """Doc positions query token ``i`` aligns to (Ã ≥ ALIGN_MIN), by alignment weight then similarity."""
    cols = np.flatnonzero(ex.align[i] >= ALIGN_MIN)
    return sorted(cols.tolist(), key=lambda j: (-float(ex.align[i, j]), -float(ex.sim[i, j]), j))


def intensity(values: np.ndarray, use_salience: bool) -> np.ndarray:
    """Shading in [0, 1]: salience / max salience, or similarity min-max scaled over the sequence."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return values
    if use_salience:
        top = values.max()
        return values / top if top > 0 else np.zeros_like(values)
    low, high = values.min(), values.max()
    return (values - low) / (high - low) if high > low else np.ones_like(values)


def _shade(level: float) -> str:
    """Background for a token at shading ``level`` in [0, 1] (squared: only the high end stands out)."""
    r, g, b = SHADE_RGB
    return f"rgba({r},{g},{b},{0.04 + 0.86 * float(level) ** 2:.2f})"


def _colour(rank: int) -> str:
    return PALETTE[rank % len(PALETTE)]


def _word_context(tokens: list[Token], j: int) -> tuple[str, str, str]:
    """(text before, token j, text after) within the word token j belongs to (glued neighbours)."""
    start = j
    while start > 0 and tokens[start].glue and not tokens[start - 1].special:
        start -= 1
    end = j + 1
    while end < len(tokens) and tokens[end].glue and not tokens[end].special:
        end += 1
    join = lambda ts: "".join(t.text for t in ts)  # noqa: E731
    return join(tokens[start:j]), tokens[j].text, join(tokens[j + 1:end])


def _fmt(x: float) -> str:
    return f"{x:.3f}"


def _token_spans(tokens: list[Token], weights: np.ndarray, levels: np.ndarray, marks: dict[int, list[int]],
                 weight_name: str) -> str:
    """Tokens as shaded spans; ``marks`` maps a position to the top-query ranks aligned with it (badges)."""
    parts = []
    for pos, (tok, w, level) in enumerate(zip(tokens, weights, levels)):
        classes = ["tok"]
        style = [f"background:{_shade(level)}"]
        badges = ""
        if tok.special:
            classes.append("special")
        ranks = marks.get(pos, [])
        if ranks:
            classes.append("aligned")
            style.append(f"outline-color:{_colour(ranks[0])}")
            badges = "".join(f'<sup class="mark" style="background:{_colour(r)}">{r + 1}</sup>' for r in ranks)
        title = html.escape(f"{tok.piece} · {weight_name} {float(w):.3f}", quote=True)
        span = (f'<span class="{" ".join(classes)}" style="{";".join(style)}" title="{title}">'
                f"{html.escape(tok.text)}</span>{badges}")
        parts.append(span if (tok.glue or pos == 0) else " " + span)
    return "".join(parts)


CSS = """
body{font-family:"DejaVu Sans",Helvetica,Arial,sans-serif;color:#1d1d1f;max-width:1120px;margin:24px auto;
 padding:0 20px;font-size:15px;background:#fff}
h1{font-size:22px;margin:0 0 6px}
h2{font-size:17px;margin:0 0 10px}
h3{font-size:13px;text-transform:uppercase;letter-spacing:.04em;color:#555;margin:18px 0 6px}
.meta{color:#555;font-size:13px;margin:2px 0}
.note{background:#fff6e0;border-left:4px solid #f0a500;padding:8px 12px;margin:12px 0;font-size:13px}
.legend{display:flex;align-items:center;gap:8px;font-size:12px;color:#555;margin:8px 0}
.ramp{width:180px;height:12px;border:1px solid #ccc;
 background:linear-gradient(90deg,rgba(255,166,0,.06),rgba(255,166,0,.9))}
.card{border:1px solid #d9d9de;border-radius:8px;padding:14px 18px;margin:18px 0;background:#fcfcfd}
.tokens{line-height:2.15;font-size:15px}
.query{font-size:17px}
.tok{padding:2px 0;border-radius:3px}
.tok.special{font-size:11px;color:#777;border:1px dashed #bbb;padding:1px 3px;margin:0 2px}
.tok.aligned{outline:2px solid;outline-offset:1px;font-weight:600}
sup.mark{font-size:10px;color:#fff;border-radius:3px;padding:0 3px;margin-left:2px;font-weight:700}
table{border-collapse:collapse;font-size:14px;margin-top:4px}
th,td{border-bottom:1px solid #e3e3e8;padding:4px 10px;text-align:left;vertical-align:top}
th{font-size:12px;color:#555;font-weight:600}
td.num{font-variant-numeric:tabular-nums;text-align:right}
.chip{display:inline-block;border:1px solid #d0d0d8;border-radius:4px;padding:0 6px;margin:1px 4px 1px 0;
 background:#fff;white-space:nowrap}
.chip b{font-weight:700}
.chip .sim{color:#666;font-size:12px;margin-left:4px;font-variant-numeric:tabular-nums}
.more{color:#777;font-size:12px}
"""


def _legend(use_salience: bool) -> str:
    what = "unary salience u (0 → max)" if use_salience else "max similarity to the other side (min → max)"
    return (f'<div class="legend">shading: <span>low</span><span class="ramp"></span><span>high</span>'
            f"<span>{html.escape(what)}</span></div>")


def _alignment_table(ex: Explanation, top: list[int], weight_name: str, max_aligned: int) -> str:
    soft = not np.isin(ex.align, (0.0, 1.0)).all()
    rows = []
    for rank, i in enumerate(top):
        chips = []
        cols = aligned_doc_tokens(ex, i)
        for j in cols[:max_aligned]:
            before, piece, after = _word_context(ex.d_tokens, j)
            weight = f" Ã {ex.align[i, j]:.2f}" if soft else ""
            weight += f" u {ex.d_weight[j]:.2f}" if ex.use_salience else ""
            chips.append(f'<span class="chip">{html.escape(before)}<b>{html.escape(piece)}</b>{html.escape(after)}'
                         f'<span class="sim">{_fmt(ex.sim[i, j])}{weight}</span></span>')
        if len(cols) > max_aligned:
            chips.append(f'<span class="more">+{len(cols) - max_aligned} more</span>')
        badge = f'<sup class="mark" style="background:{_colour(rank)}">{rank + 1}</sup>'
        rows.append(f"<tr><td>{badge}</td><td><b>{html.escape(ex.q_tokens[i].text)}</b></td>"
                    f'<td class="num">{_fmt(ex.q_weight[i])}</td><td class="num">{_fmt(ex.contribution[i])}</td>'
                    f"<td>{''.join(chips) or '<span class=more>none</span>'}</td></tr>")
    head = (f"<tr><th></th><th>query token</th><th>{html.escape(weight_name)}</th><th>share of score</th>"
            f"<th>aligned document tokens (similarity{', doc salience u' if ex.use_salience else ''})</th></tr>")
    return f'<table class="align">{head}{"".join(rows)}</table>'


def _query_cut_note(ex: Explanation) -> str:
    """A visible note when the query was longer than the model takes: its tail was neither searched nor scored."""
    if not ex.query_truncated:
        return ""
    return (f'<p class="note query-truncated">The query was truncated: the model reads only its first '
            f"{len(ex.q_tokens)} tokens (query_maxlen); the words after the last query token shown below took no "
            "part in the search or the score.</p>")


def _card(ex: Explanation, top_query: int, max_aligned: int) -> str:
    weight_name = "salience u" if ex.use_salience else "max sim"
    top = top_query_tokens(ex, top_query)
    q_marks = {i: [rank] for rank, i in enumerate(top)}
    d_marks: dict[int, list[int]] = {}
    for rank, i in enumerate(top):
        for j in aligned_doc_tokens(ex, i)[:max_aligned]:
            d_marks.setdefault(j, []).append(rank)
    rank_text = f"#{ex.rank} · " if ex.rank is not None else ""
    truncated = (' · <span title="the text beyond the model\'s doc_maxlen is not indexed">truncated</span>'
                 if ex.truncated else "")
    query_html = _token_spans(ex.q_tokens, ex.q_weight, intensity(ex.q_weight, ex.use_salience), q_marks, weight_name)
    doc_html = _token_spans(ex.d_tokens, ex.d_weight, intensity(ex.d_weight, ex.use_salience), d_marks, weight_name)
    return (f'<section class="card doc"><h2>{rank_text}document <code>{html.escape(ex.docid)}</code></h2>'
            f'<p class="meta">score <b class="score">{ex.score:.4f}</b> · strategy <code>{html.escape(ex.strategy)}'
            f"</code> · {len(ex.q_tokens)} query × {len(ex.d_tokens)} document tokens{truncated}</p>"
            f"{_query_cut_note(ex)}"
            f'<h3>query tokens</h3><div class="tokens query">{query_html}</div>'
            f"<h3>top {len(top)} query tokens → aligned document tokens (Ã of {html.escape(ex.strategy)})</h3>"
            f"{_alignment_table(ex, top, weight_name, max_aligned)}"
            f'<h3>document tokens</h3><div class="tokens document">{doc_html}</div></section>')


def render_html(explanations: list[Explanation], title: str = "AligneR explanation", top_query: int = 8,
                max_aligned: int = 8, details: dict[str, str] | None = None) -> str:
    """A self-contained HTML page (inline CSS, no scripts) with one card per explanation.

    top_query: how many of the most salient query tokens get their alignments listed and marked; max_aligned:
    aligned doc tokens shown per query token; details: extra "name: value" lines for the header (index, model…).
    """
    if not explanations:
        raise ValueError("render_html needs at least one explanation")
    if top_query < 1 or max_aligned < 1:
        raise ValueError(f"top_query and max_aligned must be >= 1, got {top_query}, {max_aligned}")
    first = explanations[0]
    lines = "".join(f'<p class="meta">{html.escape(k)}: <code>{html.escape(str(v))}</code></p>'
                    for k, v in (details or {}).items())
    note = "" if first.use_salience else (
        '<div class="note">This model scores without salience (<code>use_salience = false</code> or '
        "<code>salience_in_score = false</code>): every real token weighs 1 in the score, so tokens are shaded by their maximum similarity to any token on the other side, and query tokens are ranked "
        "by it.</div>")
    explain = ("Score = Σ S∘A / Σ A with A = Ã ∘ (u<sup>q</sup> ⊗ u<sup>d</sup>). Outlined document tokens are "
               "aligned (Ã) to the numbered query tokens; share of score = Σ<sub>j</sub> A<sub>ij</sub> "
               "S<sub>ij</sub> / Σ A.")
    cards = "".join(_card(ex, top_query, max_aligned) for ex in explanations)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"
            f'<p class="meta">query: <b class="query-text">{html.escape(first.query)}</b></p>'
            f'<p class="meta">strategy: <code>{html.escape(first.strategy)}</code></p>{lines}'
            f'<p class="meta">{explain}</p>{note}{_legend(first.use_salience)}{cards}</body></html>\n')


def _columns(ex: Explanation, max_cols: int) -> np.ndarray:
    """Doc columns for the heat map: all, or (when more than max_cols) those most aligned to any query token."""
    m = len(ex.d_tokens)
    if m <= max_cols:
        return np.arange(m)
    mass = (ex.align >= ALIGN_MIN).sum(0) + ex.sim.max(0) * 1e-3
    return np.sort(np.argsort(-mass, kind="stable")[:max_cols])


def render_png(explanations: list[Explanation], path: str | os.PathLike, max_cols: int = 80, dpi: int = 90) -> None:
    """Write a PNG: per explanation a query×doc similarity heat map with aligned cells (Ã ≥ ALIGN_MIN) outlined,
    doc-token shading above and query-token shading on the right. Docs longer than max_cols tokens show only the
    max_cols columns most aligned to query tokens. Needs matplotlib."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("--png needs matplotlib (pip install matplotlib)") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if not explanations:
        raise ValueError("render_png needs at least one explanation")
    shade = tuple(c / 255 for c in SHADE_RGB)
    widths = [len(_columns(ex, max_cols)) for ex in explanations]
    heights = [len(ex.q_tokens) for ex in explanations]
    fig_w = min(4.0 + 0.17 * max(widths), 22.0)
    panel_h = [2.2 + 0.2 * n for n in heights]
    fig = plt.figure(figsize=(fig_w, sum(panel_h)))
    outer = fig.add_gridspec(len(explanations), 1, height_ratios=panel_h, hspace=0.45)
    for p, ex in enumerate(explanations):
        cols = _columns(ex, max_cols)
        n = len(ex.q_tokens)
        grid = outer[p].subgridspec(2, 2, height_ratios=[1.0, max(n, 1) * 0.22], width_ratios=[len(cols), 6],
                                    hspace=0.04, wspace=0.02)
        heat, top, right = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[1, 1])
        image = heat.imshow(ex.sim[:, cols], aspect="auto", cmap="Blues", interpolation="nearest")
        for i, c in zip(*np.nonzero(ex.align[:, cols] >= ALIGN_MIN)):
            heat.add_patch(Rectangle((c - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="#e8112d", linewidth=1.4))
        heat.set_yticks(range(n), [t.piece for t in ex.q_tokens], fontsize=8)
        heat.set_xticks(range(len(cols)), [ex.d_tokens[j].piece for j in cols], fontsize=7, rotation=90)
        top.bar(range(len(cols)), ex.d_weight[cols], color=shade, width=0.8)
        top.set_xlim(-0.5, len(cols) - 0.5)
        top.set_xticks([])
        top.tick_params(labelsize=7)
        right.barh(range(n), ex.q_weight, color=shade, height=0.8)
        right.set_ylim(n - 0.5, -0.5)
        right.set_yticks([])
        right.set_xticks([round(float(ex.q_weight.max()), 2)])  # one tick: narrow panel
        right.tick_params(labelsize=7)
        weight = "salience u" if ex.use_salience else "max sim"
        shown = "" if len(cols) == len(ex.d_tokens) else f", {len(cols)} of {len(ex.d_tokens)} doc tokens (most aligned)"
        rank = f"#{ex.rank} " if ex.rank is not None else ""
        top.set_title(f"{rank}doc {ex.docid}  score {ex.score:.4f}  {ex.strategy}  "
                      f"(cells: similarity, red = aligned Ã; bars: {weight}{shown})", fontsize=9, loc="left")
        fig.colorbar(image, ax=right, fraction=0.5, pad=0.15).ax.tick_params(labelsize=7)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
