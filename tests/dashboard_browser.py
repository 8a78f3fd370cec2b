"""Reading a running dashboard in headless Chromium (Playwright), and the named queries of the store it read.

The browser test (tests/test_e2e_vllm.py) opens every page of a running ``kvscope up``, reads what each page shows
(metric tiles, the data plotly drew, alerts, the sidebar's widgets) and compares it with the named queries run over
the same store once ``kvscope up`` has stopped (chDB allows one process per data directory).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

_FIGURE_JS = """k => {
  const el = document.querySelector('.st-key-' + k + ' .js-plotly-plot');
  if (!el || !el._fullData) return null;
  const row = r => (r && r.length !== undefined && typeof r !== 'string') ? Array.from(r) : r;
  const arr = v => v === undefined || v === null ? [] : Array.from(v, row);
  const title = el.layout.title ? String(el.layout.title.text).replace(/<[^>]+>/g, '') : '';
  return {title: title, xrange: el.layout.xaxis ? el.layout.xaxis.range : null,
          traces: el._fullData.map(t => ({name: t.name, type: t.type, x: arr(t.x), y: arr(t.y), z: arr(t.z),
                                          text: arr(t.text), color: t.marker ? t.marker.color : null}))};
}"""
_METRICS_JS = """() => Object.fromEntries(Array.from(document.querySelectorAll("[data-testid='stMetric']")).map(m =>
  [m.querySelector("[data-testid='stMetricLabel']").innerText.trim(),
   m.querySelector("[data-testid='stMetricValue']").innerText.trim()]))"""


def figure(page: Any, key: str) -> dict[str, Any] | None:
    """The plotly chart with Streamlit ``key`` as drawn: title, x-axis range, and each trace's name, type, x, y, z,
    text and marker colour (decoded arrays)."""
    return page.evaluate(_FIGURE_JS, key)


def metrics(page: Any) -> dict[str, str]:
    """Metric tiles on the page: label → shown value."""
    return page.evaluate(_METRICS_JS)


def alerts(page: Any) -> list[str]:
    """The text of every info, success, warning and error box."""
    return page.locator("[data-testid='stAlert']").all_inner_texts()


def widget(page: Any, key: str) -> str:
    """The value a sidebar widget shows (select box or date/time input)."""
    return page.locator(f".st-key-{key} input").first.input_value()


def points(fig: dict[str, Any], name: str) -> dict[str, float]:
    """x → y of the trace called ``name`` and its partial-bucket markers (the chart splits them), None dropped."""
    out = {}
    for t in fig["traces"]:
        if t["name"] in (name, f"{name} (partial bucket)"):
            out.update({_x(x): y for x, y in zip(t["x"], t["y"], strict=True) if y is not None and y == y})
    return out


def _x(x: Any) -> str:
    """A time axis value as 'YYYY-MM-DD HH:MM:SS' (plotly keeps what it was given), anything else as is."""
    return str(x).replace("T", " ")[:19] if isinstance(x, str) and x[:2] == "20" else x


def constant(module: str, name: str) -> Any:
    """A module-level constant of a dashboard page (``module``: path from the repository root), read from its
    source: importing a page would run it."""
    tree = ast.parse((ROOT / module).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == name)
    return eval(compile(ast.Expression(node.value), module, "eval"), {})  # noqa: S307  (our own source)


def bucket_key(t: datetime | str) -> str:
    return str(t)[:19].replace("T", " ")


def named_over(data_dir: Path, database: str, queries: dict[str, tuple[str, dict[str, str]]],
               sql: dict[str, str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Runs each named query (label → (name, params)) and each ad hoc statement (label → SQL) over the chDB store
    at ``data_dir`` in a fresh process (the dashboard's process has stopped), returning label → rows."""
    script = (
        "import json, sys\n"
        "from ingest.store import Store\n"
        "spec = json.loads(sys.stdin.read())\n"
        "s = Store.open(data_dir=spec['dir'], database=spec['db'])\n"
        "out = {k: s.named(n, p).to_dicts() for k, (n, p) in spec['q'].items()}\n"
        "out.update({k: s.adhoc(v).to_dicts() for k, v in spec['sql'].items()})\n"
        "print(json.dumps(out, default=str))\n"
    )
    spec = json.dumps({"dir": str(data_dir), "db": database, "q": queries, "sql": sql or {}})
    done = subprocess.run([sys.executable, "-c", script], input=spec, capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
