"""The report of a ``reproduce`` run: ``report.md``, a self-contained ``report.html`` (plots embedded as
PNG data), ``results.json`` (measured values only, no timings, so runs on different schedulers compare
bit for bit) and one PNG per plotted experiment (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from .claims import Experiment, Finding

VERDICT_MARK = {"holds": "holds", "holds with a caveat": "holds (caveat)", "fails": "FAILS",
                "not measured": "not measured"}


def results_json(findings: list[tuple[Experiment, Finding, list]], quick: bool) -> dict:
    return {
        "quick": quick,
        "experiments": [
            {"name": e.name, "ref": e.ref, "claim": e.claim, "verdict": f.verdict, "caveat": f.caveat,
             "measured": f.measured, "table": f.table,
             "tasks": [{"key": r["key"], "params": r["params"], "value": r["value"], "error": r["error"]}
                       for r in recs]}
            for e, f, recs in findings],
    }


def draw(name: str, plot: dict, out: Path) -> Path | None:
    """One PNG for an experiment's plot spec; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if plot["kind"] == "bars":
        return _draw_bars(name, plot, out, plt)
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for label, pts in plot["series"].items():
        pts = [p for p in pts if p[1] is not None and p[1] > 0] if plot.get("logy") else pts
        if not pts:
            continue
        xs, ys = zip(*sorted(pts))
        if plot["kind"] == "scatter":
            ax.scatter(xs, ys, label=label, s=18, alpha=0.8)
        else:
            ax.plot(xs, ys, marker="o", label=label)
    if plot.get("logy"):
        ax.set_yscale("log")
    if plot.get("logx"):
        ax.set_xscale("log", base=plot.get("xbase", 10))
    ax.set_xlabel(plot["x"])
    ax.set_ylabel(plot["y"])
    ax.set_title(name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_bars(name: str, plot: dict, out: Path, plt) -> Path:
    """Horizontal bars, one per label (``series``: {name: [[label, value], ...]}, the first series drawn)."""
    pts = next(iter(plot["series"].values()), [])
    labels = [str(p[0]) for p in pts]
    vals = [float(p[1]) for p in pts]
    fig, ax = plt.subplots(figsize=(10, 0.8 + 0.24 * max(1, len(pts))))
    ys = list(range(len(pts)))[::-1]
    colors = ["#17702a" if v >= plot.get("good", 0.95) else "#b00020" for v in vals]
    ax.barh(ys, vals, color=colors, height=0.7)
    ax.set_yticks(ys)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlim(0, 1.0)
    if plot.get("good") is not None:
        ax.axvline(plot["good"], color="#555", lw=0.8, ls="--")
    ax.set_xlabel(plot["x"])
    ax.set_title(name)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")     # long labels widen the image, never clipped
    plt.close(fig)
    return path


def text_table(rows: list[dict], cols: list[str] | None = None) -> str:
    """A plain-text table (columns padded to their widest cell, never cut to a terminal width)."""
    if not rows:
        return ""
    cols = cols or list(dict.fromkeys(k for r in rows for k in r))
    cells = [[str(c) for c in cols]] + [[str(r.get(c, "")) for c in cols] for r in rows]
    width = [max(len(line[i]) for line in cells) for i in range(len(cols))]
    out = ["  ".join(x.ljust(w) for x, w in zip(line, width)).rstrip() for line in cells]
    out.insert(1, "  ".join("-" * w for w in width))
    return "\n".join(out)


def _md_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


def write_report(out: Path, findings: list[tuple[Experiment, Finding, list]], *, quick: bool, command: str,
                 summary_line: str) -> dict:
    """Write every file; returns {"report.md": path, ...}."""
    out.mkdir(parents=True, exist_ok=True)
    plots = {}
    for e, f, _ in findings:
        if f.plot:
            p = draw(e.name, f.plot, out)
            if p is not None:
                plots[e.name] = p
    res = results_json(findings, quick)
    (out / "results.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")

    md = [f"# headthief reproduce{' (quick)' if quick else ''}", "", f"Command: `{command}`", "",
          summary_line, "", "| claim | verdict | measured |", "|---|---|---|"]
    for e, f, _ in findings:
        verdict = VERDICT_MARK.get(f.verdict, f.verdict) + (f": {f.caveat}" if f.caveat else "")
        md.append(f"| {e.ref} | {verdict} | {f.measured} |")
    for e, f, recs in findings:
        md += ["", f"## {e.ref} ({e.name})", "", f"> {e.claim}", "", f"**Verdict: {f.verdict}**"
               + (f" — {f.caveat}" if f.caveat else ""), "", f"Measured: {f.measured}", ""]
        if f.table:
            md += [_md_table(f.table), ""]
        if e.name in plots:
            md += [f"![{e.name}]({plots[e.name].name})", ""]
        bad = [r for r in recs if r.get("error")]
        if bad:
            md += [f"{len(bad)} task(s) failed:", ""] + [f"- `{r['key']}` {r['params']}: {r['error']}" for r in bad] + [""]
    (out / "report.md").write_text("\n".join(md) + "\n")

    h = ["<!doctype html><html><head><meta charset='utf-8'><title>headthief reproduce</title><style>",
         "body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}",
         "table{border-collapse:collapse;margin:1em 0;font-size:0.9em}td,th{border:1px solid #ccc;padding:4px 8px}",
         ".holds{color:#17702a;font-weight:bold}.caveat{color:#946200;font-weight:bold}.fails{color:#b00020;font-weight:bold}",
         "blockquote{color:#555;border-left:3px solid #ccc;margin-left:0;padding-left:1em}img{max-width:100%}",
         "</style></head><body>", f"<h1>headthief reproduce{' (quick)' if quick else ''}</h1>",
         f"<p>Command: <code>{html.escape(command)}</code></p><p>{html.escape(summary_line)}</p>",
         "<table><tr><th>claim</th><th>verdict</th><th>measured</th></tr>"]

    def cls(v):
        return {"holds": "holds", "holds with a caveat": "caveat"}.get(v, "fails")
    for e, f, _ in findings:
        h.append(f"<tr><td><a href='#{e.name}'>{html.escape(e.ref)}</a></td><td class='{cls(f.verdict)}'>"
                 f"{html.escape(f.verdict)}{(': ' + html.escape(f.caveat)) if f.caveat else ''}</td>"
                 f"<td>{html.escape(f.measured)}</td></tr>")
    h.append("</table>")
    for e, f, _ in findings:
        h += [f"<h2 id='{e.name}'>{html.escape(e.ref)}</h2>", f"<blockquote>{html.escape(e.claim)}</blockquote>",
              f"<p class='{cls(f.verdict)}'>Verdict: {html.escape(f.verdict)}</p>",
              f"<p>Measured: {html.escape(f.measured)}</p>"]
        if f.table:
            cols = list(dict.fromkeys(k for r in f.table for k in r))
            h.append("<table><tr>" + "".join(f"<th>{html.escape(str(c))}</th>" for c in cols) + "</tr>")
            for r in f.table:
                h.append("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in cols) + "</tr>")
            h.append("</table>")
        if e.name in plots:
            data = base64.b64encode(plots[e.name].read_bytes()).decode()
            h.append(f"<img alt='{e.name}' src='data:image/png;base64,{data}'>")
    h.append("</body></html>")
    (out / "report.html").write_text("\n".join(h) + "\n")
    return {"report.md": out / "report.md", "report.html": out / "report.html", "results.json": out / "results.json",
            **{f"{k}.png": v for k, v in plots.items()}}
