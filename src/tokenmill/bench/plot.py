"""Figures of a run: latency-throughput curves of the sweep and TTFT/TPOT
distributions per load point. PNG via matplotlib (imported only here, so
`tokenmill bench` without --plot never pays for it); ``.html`` gives a
self-contained page with the PNG inlined and the text report beside it.
"""
from __future__ import annotations

import base64
import html
import io
from typing import Any


def _cdf(ax: Any, values: list[float], label: str) -> None:
    xs = sorted(v * 1000 for v in values)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def figure_png(result: dict[str, Any]) -> bytes:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'tokenmill[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result.get("points", [])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_ttft, ax_tpot), (ax_cdf1, ax_cdf2) = axes
    xs = [p["summary"]["output_throughput"] for p in points]
    for ax, key, name in ((ax_ttft, "ttft", "TTFT"), (ax_tpot, "tpot", "TPOT")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [(p["summary"][key][q] or 0) * 1000 for p in points]
            ax.plot(xs, ys, style, label=f"{name} {q}")
        for p, x in zip(points, xs):
            y = (p["summary"][key]["p50"] or 0) * 1000
            ax.annotate(p["label"], (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} vs throughput")
        ax.grid(alpha=0.3)
        ax.legend()
    for p in points:
        recs = [r for r in p.get("records", []) if r.get("ok")]
        _cdf(ax_cdf1, [r["ttft"] for r in recs if r.get("ttft") is not None], p["label"])
        _cdf(ax_cdf2, [r["tpot"] for r in recs if r.get("tpot") is not None], p["label"])
    for ax, name in ((ax_cdf1, "TTFT"), (ax_cdf2, "TPOT")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} distribution")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    tgt = result.get("target", {})
    fig.suptitle(f"{tgt.get('model', '')} @ {tgt.get('base_url', '')}", fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_plot(result: dict[str, Any], path: str, report_text: str = "") -> None:
    png = figure_png(result)
    if path.lower().endswith((".html", ".htm")):
        b64 = base64.b64encode(png).decode()
        page = ("<!doctype html><meta charset='utf-8'><title>tokenmill bench</title>"
                "<body style='font-family:sans-serif'>"
                f"<h1>tokenmill bench</h1><img alt='latency and throughput' "
                f"src='data:image/png;base64,{b64}' style='max-width:100%'>"
                f"<pre>{html.escape(report_text)}</pre></body>")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(page)
    else:
        with open(path, "wb") as fh:
            fh.write(png)
