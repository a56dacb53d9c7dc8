"""`pipeline report RUN_DIR`: one self-contained HTML page per run (RUN_DIR/report.html: plots as inline SVG, no
script, no server, opens offline) and the JSON of every figure it shows (RUN_DIR/report.json): the training
curves (loss with validation and each source's validation loss, learning rate, tokens/s, MFU by the PaLM count),
each evaluation of the run (`pipeline evaluate` results in RUN_DIR/eval: loss by source, the base model against
the continued one with the change's standard error, the needle test), the run's config and environment."""

from __future__ import annotations

import html
import io
import json
from pathlib import Path
from typing import Any

from pipeline.atomic import write_json, write_text
from pipeline.errors import PipelineError

PLOTS = {
    "loss": ("loss (nats/token)", ("loss", "val_loss")),
    "learning_rate": ("learning rate", ("lr",)),
    "throughput": ("tokens/s", ("tokens_per_s",)),
    "mfu": ("MFU (PaLM count: 6N + 12*L*h*s per token)", ("mfu",)),
}
"""Each plot: its axis label and the metrics.jsonl series it draws (the loss plot adds each source's val_loss/NAME)."""


def build(run_dir: Path) -> dict[str, Any]:
    """What the report shows, read from the run folder; one line where it is not a run folder."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise PipelineError(
            f"{run_dir}: no metrics.jsonl: not a training run folder (give RUN_DIR of `pipeline pretrain`)"
        )
    records, lines = [], metrics.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n < len(lines):  # only the last line may be half written (a run logging now)
                raise PipelineError(f"{metrics}:{n}: not a JSON line; the file was altered") from None
    keys = sorted({k for r in records for k in r if isinstance(r.get(k), (int, float)) and k != "step"})
    curves = {
        k: [[r["step"], r[k]] for r in records if isinstance(r.get(k), (int, float)) and "step" in r] for k in keys
    }
    evaluations = []
    for path in sorted((run_dir / "eval").glob("*.json")) if (run_dir / "eval").is_dir() else []:
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(result, dict) and "loss" in result:
            evaluations.append({"file": path.name, **_evaluation(result)})
    evaluations.sort(key=lambda e: (e["step"], e["file"]))
    environment = run_dir / "environment.json"
    config = run_dir / "config.yaml"
    return {
        "run_dir": str(run_dir),
        "curves": curves,
        "evaluations": evaluations,
        "config": config.read_text() if config.is_file() else None,
        "environment": json.loads(environment.read_text()) if environment.is_file() else None,
    }


def _evaluation(r: dict[str, Any]) -> dict[str, Any]:
    """The figures of one evaluation result the report shows."""
    keep = ("checkpoint", "step", "split", "loss", "perplexity", "bits_per_byte", "tokens", "by_source", "change")
    out: dict[str, Any] = {k: r.get(k) for k in keep}
    out["averaged"] = r.get("averaged") or []
    if base := r.get("baseline"):
        against: dict[str, Any] = {
            k: base.get(k) for k in ("model", "loss", "perplexity", "bits_per_byte", "by_source")
        }
        if base.get("needle"):
            against["needle"] = base["needle"]["by_length"]
        out["baseline"] = against
    if r.get("needle"):
        out["needle"] = r["needle"]["by_length"]
    return out


def plots(data: dict[str, Any]) -> dict[str, str]:
    """Each plot with data as an SVG document (matplotlib, no fonts or images fetched), by name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = data["curves"]
    out = {}
    for name, (label, series) in PLOTS.items():
        drawn = [s for s in series if curves.get(s)]
        if name == "loss":
            drawn += [k for k in sorted(curves) if k.startswith("val_loss/")]
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for s in drawn:
            xs, ys = zip(*curves[s], strict=True)
            ax.plot(xs, ys, "o-" if s.startswith("val_loss") else "-", label=s, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if len(drawn) > 1:
            ax.legend()
        buf = io.StringIO()
        fig.savefig(buf, format="svg", bbox_inches="tight")
        plt.close(fig)
        svg = buf.getvalue()
        out[name] = svg[svg.index("<svg") :]  # inline: no XML prolog or doctype
    return out


def _num(value: Any, digits: int = 4, key: str = "") -> str:
    """A number as the page shows it, its exact JSON value in data-value (the browser test compares them)."""
    if value is None:
        return "<td>n/a</td>"
    shown = f"{value:,}" if isinstance(value, int) else f"{value:.{digits}f}"
    return f'<td class="num" data-key="{html.escape(key)}" data-value="{value!r}">{shown}</td>'


def render(data: dict[str, Any], svgs: dict[str, str]) -> str:
    """The page: a heading, the plots, a table per evaluation, the config and environment."""
    e = html.escape
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(Path(data['run_dir']).name)}: training report</title>",
        "<style>body{font-family:sans-serif;max-width:960px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em}"
        "td.num{text-align:right;font-variant-numeric:tabular-nums}figure{margin:1em 0}"
        "pre{background:#f6f6f6;padding:1em;overflow:auto}</style></head><body>",
        f"<h1>{e(Path(data['run_dir']).name)}</h1>",
        f"<p>Run folder <code>{e(data['run_dir'])}</code>. Every figure on this page is in report.json beside it. "
        "MFU is counted the PaLM way (6N + 12&middot;L&middot;h&middot;s FLOPs per token).</p>",
        "<h2>Training</h2>",
    ]
    for name, svg in svgs.items():
        parts.append(f'<figure class="plot" data-plot="{e(name)}">{svg}<figcaption>{e(name)}</figcaption></figure>')
    if not svgs:
        parts.append("<p>No step was logged yet.</p>")
    parts.append("<h2>Evaluations</h2>")
    if not data["evaluations"]:
        parts.append(
            "<p>None yet: <code>pipeline evaluate --checkpoint RUN_DIR [--baseline] [--needle N,M]</code>.</p>"
        )
    for i, ev in enumerate(data["evaluations"]):
        parts.append(_evaluation_html(i, ev))
    parts.append("<h2>Config</h2>")
    parts.append(f"<pre>{e(data['config'] or '(no config.yaml)')}</pre>")
    parts.append("<h2>Environment</h2>")
    env = json.dumps(data["environment"], indent=2) if data["environment"] is not None else "(no environment.json)"
    parts.append(f"<pre>{e(env)}</pre></body></html>")
    return "\n".join(parts) + "\n"


def _evaluation_html(i: int, ev: dict[str, Any]) -> str:
    e = html.escape
    at = f"evaluations.{i}"
    title = f"{ev['file']}: step {ev['step']:,}, split {ev['split']}"
    if ev["averaged"]:
        title += f", the mean of {len(ev['averaged'])} checkpoints"
    rows = [f"<h3>{e(title)}</h3>", "<table><tr><th>source</th><th>loss</th><th>perplexity</th><th>bits per byte</th>"]
    base = ev.get("baseline")
    if base:
        rows[-1] += "<th>base loss</th><th>change</th><th>± std. error</th>"
    rows[-1] += "</tr>"
    change = {c["source"]: (k, c) for k, c in enumerate(ev.get("change") or [])}
    lines = [("total", ev, None, f"{at}")] + [
        (s["source"], s, k, f"{at}.by_source.{k}") for k, s in enumerate(ev.get("by_source") or [])
    ]
    base_by = {s["source"]: (k, s) for k, s in enumerate((base or {}).get("by_source") or [])}
    for name, fig, k, key in lines:
        cells = [f"<td>{e(name)}</td>", _num(fig["loss"], 4, f"{key}.loss")]
        cells += [
            _num(fig["perplexity"], 2, f"{key}.perplexity"),
            _num(fig["bits_per_byte"], 4, f"{key}.bits_per_byte"),
        ]
        if base:
            b_key, b = (
                (f"{at}.baseline", base)
                if k is None
                else (f"{at}.baseline.by_source.{base_by[name][0]}", base_by[name][1])
            )
            cells.append(_num(b["loss"], 4, f"{b_key}.loss"))
            c_at, c = change.get(name, (None, None))
            cells.append(_num(c["loss_change"] if c else None, 4, f"{at}.change.{c_at}.loss_change"))
            cells.append(_num(c["stderr"] if c else None, 4, f"{at}.change.{c_at}.stderr"))
        rows.append("<tr>" + "".join(cells) + "</tr>")
    rows.append("</table>")
    if base:
        rows.append(f"<p>Base model: <code>{e(str(base['model']))}</code>, on the same samples.</p>")
    for who, found, key in (
        ("needle", ev.get("needle"), f"{at}.needle"),
        ("base's needle", (base or {}).get("needle"), f"{at}.baseline.needle"),
    ):
        if not found:
            continue
        rows.append(f"<table><tr><th>{e(who)}: length</th><th>found</th><th>answer loss</th></tr>")
        for j, b in enumerate(found):
            rows.append(
                f"<tr><td>{b['length']:,}</td>{_num(b['found'], 3, f'{key}.{j}.found')}"
                f"{_num(b['answer_loss'], 3, f'{key}.{j}.answer_loss')}</tr>"
            )
        rows.append("</table>")
    return "\n".join(rows)


def write_report(run_dir: str | Path, output: str | Path | None = None) -> tuple[Path, Path]:
    """RUN_DIR/report.html (or `output`) and the JSON beside it; re-running replaces both."""
    run_dir = Path(run_dir)
    data = build(run_dir)
    svgs = plots(data)
    data["plots"] = list(svgs)
    page = Path(output) if output else run_dir / "report.html"
    figures = page.with_suffix(".json")
    write_json(figures, data)
    write_text(page, render(data, svgs))
    return page, figures
