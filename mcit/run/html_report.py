"""report.html: one self-contained page per run or sweep, written beside report.md / aggregate.md.

What researchers do with a run's results is look at them: which tasks collapsed and when, which questions were
forgotten, how the curves move. The page holds everything inline (figures as SVG from matplotlib, thumbnails as
``data:`` PNGs, one small script for sortable tables and paging), so it opens from disk offline, is mailed or
attached to a paper's supplement as one file, and loads nothing from a network.

Every number in a table cell carries ``data-key`` and ``data-value`` (the full float): the browser test and any
scraper read the numbers the page shows without parsing the text.

* A run (``run_html``): the metrics (the continual-learning ones and MCITlib's columns), the accuracy matrix as a
  table and a heatmap, each task's accuracy across the sequence, the training loss of every task (``logs/
  train.jsonl``, the last record of each step: a resumed run's redone steps counted once) and the first task's
  loss after each task; for instruction tasks, what was forgotten: per task, the questions whose score fell
  between the row after that task and the final row, and those that recovered, with the question, the reference,
  both answers and the image (``REPORT_SAMPLES`` per task and direction, ``REPORT_PAGE`` per page).
* A sweep (``sweep_html``): the mean ± std table (sortable), per-configuration bars with their std, and the
  mean accuracy matrices side by side.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any, Iterable

from mcit.core import metrics as M
from mcit.core.checkpoint import atomic_write_text
from mcit.core.rundir import RunDir

REPORT_SAMPLES = 200  # per task and direction (forgotten / recovered): the page stays small for 100k-question splits
REPORT_PAGE = 20
THUMBNAIL_PX = 96
DESCRIPTIONS = {
    "final_avg_acc": "accuracy over every test sample after the last task",
    "final_avg_acc_task_mean": "mean of the last row",
    "avg_incremental_acc": "mean over steps of the mean accuracy on the tasks seen so far",
    "avg_incremental_acc_sample_weighted": "the same, sample-weighted",
    "forgetting": "mean drop from each task's best to its final accuracy (Chaudhry et al. 2018)",
    "forgetting_mammoth": "mammoth's forgetting (the maximum includes the last row)",
    "bwt": "backward transfer: final minus just-learned accuracy, mean over tasks (Lopez-Paz & Ranzato 2017)",
    "fwd": "forward transfer: accuracy before learning a task minus its zero-shot accuracy",
    "mft": "MCITlib's MFT: mean of the diagonal", "mfn": "MCITlib's MFN: mean of the last row",
    "maa": "MCITlib's MAA: average incremental accuracy",
}

_STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1200px;color:#222;
padding:0 16px}
h1{font-size:1.6em}h2{margin-top:1.8em;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;margin:8px 0}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right;white-space:nowrap}
td.l{white-space:normal}
th{background:#f3f3f3;cursor:default}th.sortable{cursor:pointer}td.l,th.l{text-align:left}
.meta{color:#555}.figs{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}.figs svg{max-width:100%;height:auto}
.sample img{width:96px;height:96px;image-rendering:pixelated}.pager button{margin:0 2px}
.small{font-size:.85em;color:#555}.bad{color:#b00}.good{color:#070}
"""

# Sorting by a column's data-value (numbers) or text; paging of the forgotten-sample tables. No network, no eval.
_SCRIPT = """
(function(){
function val(td){var v=td.getAttribute('data-value');if(v!==null&&v!==''&&!isNaN(+v))return +v;return td.textContent;}
document.querySelectorAll('table.sortable').forEach(function(t){
 t.querySelectorAll('th').forEach(function(th,i){th.classList.add('sortable');th.addEventListener('click',function(){
  var body=t.tBodies[0],rows=Array.prototype.slice.call(body.rows),up=th.getAttribute('data-dir')!=='up';
  rows.sort(function(a,b){var x=val(a.cells[i]),y=val(b.cells[i]);if(x===y)return 0;
   var r=(typeof x==='number'&&typeof y==='number')?x-y:String(x).localeCompare(String(y));return up?r:-r;});
  th.setAttribute('data-dir',up?'up':'down');rows.forEach(function(r){body.appendChild(r);});});});});
document.querySelectorAll('table.paged').forEach(function(t){
 var size=+t.getAttribute('data-page'),rows=t.tBodies[0].rows,n=Math.ceil(rows.length/size),p=t.nextElementSibling;
 function show(k){for(var i=0;i<rows.length;i++)rows[i].style.display=(Math.floor(i/size)===k)?'':'none';
  if(p)p.querySelector('span').textContent='page '+(k+1)+' of '+n;}
 if(p&&n>1){var k=0;p.querySelector('.prev').addEventListener('click',function(){if(k>0)show(--k);});
  p.querySelector('.next').addEventListener('click',function(){if(k<n-1)show(++k);});}
 else if(p){p.style.display='none';}
 show(0);});
})();
"""


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def num(key: str, value: Any, digits: int = 2, cls: str = "") -> str:
    """A table cell holding a number: shown rounded, its full value in data-value (n/a for None)."""
    c = f' class="{cls}"' if cls else ""
    if value is None:
        return f'<td data-key="{esc(key)}" data-value=""{c}>n/a</td>'
    return f'<td data-key="{esc(key)}" data-value="{float(value)!r}"{c}>{float(value):.{digits}f}</td>'


def page(title: str, body: str) -> str:
    """The whole document: inline style and script, no external reference of any kind."""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{esc(title)}</title><style>{_STYLE}</style></head><body>\n{body}\n"
            f"<script>{_SCRIPT}</script></body></html>\n")


def svg(fig: Any) -> str:
    """A matplotlib figure as inline SVG (text as paths: no font to fetch), the figure closed."""
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    with plt.rc_context({"svg.fonttype": "path", "svg.hashsalt": "mcit"}):  # the same page for the same run
        fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


# -- a run -------------------------------------------------------------------------------------------------------
def heatmap_svg(tasks: list[str], acc: list[list[float]], rows: list[str], title: str) -> str:
    import numpy as np

    plt = _pyplot()
    a = np.asarray(acc, dtype=float)
    fig, ax = plt.subplots(figsize=(1.6 + 0.8 * len(tasks), 1.6 + 0.6 * len(rows)))
    im = ax.imshow(a, vmin=0, vmax=100, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(tasks)), tasks, rotation=45, ha="right")
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("evaluated on")
    for t in range(a.shape[0]):
        for i in range(a.shape[1]):
            ax.text(i, t, f"{a[t, i]:.0f}", ha="center", va="center", color="w" if a[t, i] < 60 else "k", fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy (%)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return svg(fig)


def curves_svg(tasks: list[str], acc: list[list[float]], zero_shot: list[float] | None, rows: list[str]) -> str:
    """Each task's accuracy across the sequence (x: the rows, zero-shot first)."""
    plt = _pyplot()
    xs = (["zero-shot"] if zero_shot is not None else []) + [f"after {r}" for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, name in enumerate(tasks):
        ys = ([zero_shot[i]] if zero_shot is not None else []) + [row[i] for row in acc]
        ax.plot(range(len(xs)), ys, marker="o", label=name)
    ax.set_xticks(range(len(xs)), xs, rotation=30, ha="right")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(-2, 102)
    ax.set_title("each task's accuracy across the sequence", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return svg(fig)


def training_losses(run: RunDir) -> dict[int, list[tuple[int, float]]]:
    """Per task, (step, loss) of the training log: a step logged twice (redone after a resume) counts once, its
    last record."""
    out: dict[int, dict[int, float]] = {}
    if not run.train_log.is_file():
        return {}
    for line in run.train_log.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:  # a line cut by a kill
            continue
        if "loss" in r and "task" in r and "step" in r:
            out.setdefault(int(r["task"]), {})[int(r["step"])] = float(r["loss"])
    return {t: sorted(d.items()) for t, d in sorted(out.items())}


def loss_svg(losses: dict[int, list[tuple[int, float]]], tasks: list[str], first_loss: list[Any], rows: list[str]
             ) -> str:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    ax = axes[0]
    offset = 0
    for t, pts in losses.items():
        ax.plot([offset + s for s, _ in pts], [v for _, v in pts], label=tasks[t] if t < len(tasks) else str(t))
        offset += max(s for s, _ in pts) if pts else 0
    ax.set_xlabel("optimizer step (tasks one after another)")
    ax.set_ylabel("training loss")
    ax.set_title("training loss", fontsize=10)
    ax.grid(alpha=0.3)
    if losses:
        ax.legend(fontsize=8)
    ax = axes[1]
    pts = [(i, v) for i, v in enumerate(first_loss) if v is not None]
    if pts:
        ax.plot([i for i, _ in pts], [v for _, v in pts], marker="o")
        ax.set_xticks([i for i, _ in pts], [f"after {rows[i]}" for i, _ in pts], rotation=30, ha="right")
    else:
        ax.text(0.5, 0.5, "not recorded by this method", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("loss")
    ax.set_title("the first task's loss after each task", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return svg(fig)


def _read_answers(path: Path) -> dict[str, dict[str, Any]]:
    if not path.is_file():
        return {}
    return {r["key"]: r for r in map(json.loads, path.read_text().splitlines()) if "key" in r}


def forgotten(run: RunDir, task: int, last: int) -> tuple[list[tuple[dict, dict]], list[tuple[dict, dict]]]:
    """(forgotten, recovered) of task ``task``: (answer after the task, final answer) pairs whose score fell /
    rose between row ``task`` and row ``last``, the largest changes first, then by key."""
    before = _read_answers(run.answers(task) / f"{task}.jsonl")
    after = _read_answers(run.answers(last) / f"{task}.jsonl")
    fell, rose = [], []
    for key in sorted(before.keys() & after.keys()):
        b, a = before[key], after[key]
        sb, sa = b.get("score"), a.get("score")
        if sb is None or sa is None:
            continue
        if float(sa) < float(sb):
            fell.append((b, a))
        elif float(sa) > float(sb):
            rose.append((b, a))
    fell.sort(key=lambda p: float(p[1]["score"]) - float(p[0]["score"]))
    rose.sort(key=lambda p: float(p[0]["score"]) - float(p[1]["score"]))
    return fell, rose


def thumbnails(splits: list[Any], wanted: dict[int, set[str]]) -> dict[tuple[int, str], str]:
    """``data:`` PNG thumbnails of the wanted samples' images, read from the test splits (one pass over each split
    that has a wanted key, stopped once all are found); a split that cannot be read gives none."""
    from PIL import Image

    from mcit.data.instructions import IMAGE_EXTS
    from mcit.data.shards import iter_samples

    out: dict[tuple[int, str], str] = {}
    for i, keys in wanted.items():
        if not keys or i >= len(splits) or splits[i] is None:
            continue
        left = set(keys)
        try:
            for s in iter_samples(splits[i], 0, 1, policy="sample"):
                if s.get("__key__") not in left:
                    continue
                data = next((s[e] for e in IMAGE_EXTS if e in s), None)
                left.discard(s["__key__"])
                if data is not None:
                    img = Image.open(io.BytesIO(data)).convert("RGB")
                    img.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
                    buf = io.BytesIO()
                    img.save(buf, format="PNG")
                    out[(i, s["__key__"])] = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
                if not left:
                    break
        except Exception:  # noqa: BLE001 - a moved or unreadable split: the page is written without its images
            continue
    return out


def _question(row: dict[str, Any]) -> str:
    return str(row.get("question") or row.get("first_question") or "")


def sample_table(task: int, name: str, kind: str, pairs: list[tuple[dict, dict]], thumbs: dict[tuple[int, str], str],
                 rows: tuple[str, str]) -> str:
    total = len(pairs)
    shown = pairs[:REPORT_SAMPLES]
    cap = f" (the {len(shown)} largest changes shown)" if total > len(shown) else ""
    head = (f'<h4>{esc(name)}: {total} {kind}{cap}</h4>')
    if not shown:
        return head
    body = []
    for b, a in shown:
        key = b["key"]
        src = thumbs.get((task, key))
        img = f'<img alt="{esc(key)}" src="{src}">' if src else ""
        ref = " | ".join(map(str, b.get("answers") or [])) or str(b.get("answer", ""))
        body.append(f'<tr class="sample"><td class="l">{img}</td><td class="l">{esc(key)}</td>'
                    f'<td class="l">{esc(_question(b))}</td><td class="l">{esc(ref)}</td>'
                    f'<td class="l">{esc(b.get("prediction", ""))}</td>{num("score_before", b.get("score"))}'
                    f'<td class="l">{esc(a.get("prediction", ""))}</td>{num("score_after", a.get("score"))}</tr>')
    return (head + f'<table class="paged samples" data-task="{task}" data-kind="{esc(kind)}" '
            f'data-page="{REPORT_PAGE}"><thead><tr><th class="l">image</th><th class="l">key</th>'
            f'<th class="l">question</th><th class="l">reference</th><th class="l">answer {esc(rows[0])}</th>'
            f'<th>score</th><th class="l">answer {esc(rows[1])}</th><th>score</th></tr></thead><tbody>'
            + "".join(body) + '</tbody></table><div class="pager"><button class="prev">&lt;</button><span></span>'
            '<button class="next">&gt;</button></div>')


def forgotten_section(run: RunDir, m: dict[str, Any], splits: list[Any] | None) -> str:
    tasks, acc = m["tasks"], m["acc_matrix"]
    T = len(acc)
    if T < 2 or m.get("schedule") == "joint" or not run.answers(T - 1).is_dir():
        return ""
    rows = m.get("rows") or tasks
    found = [(i, *forgotten(run, i, T - 1)) for i in range(T - 1)]
    wanted = {i: {p[0]["key"] for p in fell[:REPORT_SAMPLES] + rose[:REPORT_SAMPLES]} for i, fell, rose in found}
    thumbs = thumbnails(splits if splits is not None else test_splits(run), wanted)
    parts = []
    for i, fell, rose in found:
        labels = (f"after {rows[i]}", f"after {rows[T - 1]}")
        parts.append(f'<h3>{esc(tasks[i])}</h3><p class="small">{len(fell)} forgotten, {len(rose)} recovered between '
                     f"{esc(labels[0])} and {esc(labels[1])} (accuracy {acc[i][i]:.2f} &rarr; "
                     f"{acc[T - 1][i]:.2f})</p>"
                     + sample_table(i, tasks[i], "forgotten", fell, thumbs, labels)
                     + sample_table(i, tasks[i], "recovered", rose, thumbs, labels))
    return ('<h2 id="forgotten">What was forgotten</h2><p class="small">Per task, the questions whose score fell '
            "between the row after that task and the final row, and those that recovered, read from the stored "
            "answers.</p>" + "".join(parts))


def test_splits(run: RunDir) -> list[Any]:
    """The run's test splits as its config names them (paths relative to where the report is written); one that
    cannot be opened is None."""
    from mcit.core.config import load_config
    from mcit.data.shards import open_split

    try:
        cfg = load_config(run.root / "config.yaml", [])
        specs = cfg.data.resolved_tasks(Path.cwd())
    except Exception:  # noqa: BLE001 - the report is written without thumbnails
        return []
    out: list[Any] = []
    for s in specs:
        try:
            out.append(open_split(s.test, False))
        except Exception:  # noqa: BLE001
            out.append(None)
    return out


def run_html(run_dir: Path, splits: list[Any] | None = None, extra: str = "") -> str:
    """The page of a finished run (``splits``: its test splits, when the caller has them open; ``extra``: more
    sections, e.g. ``published_html``)."""
    run = RunDir(run_dir)
    m = json.loads(run.metrics.read_text())
    tasks, acc, zs = m["tasks"], m["acc_matrix"], m.get("zero_shot")
    rows = m.get("rows") or tasks
    title = f"{m['name']} ({m['method']})"
    sha = (m.get("backbone_sha256") or "")[:16]
    head = (f"<h1>{esc(title)}</h1><p class=\"meta\">method <b>{esc(m['method'])}</b> · backbone "
            f"<b>{esc(m.get('backbone'))}</b>{f' (sha256 {esc(sha)})' if sha else ''} · seed {esc(m.get('seed'))}"
            f" · tasks {esc(', '.join(tasks))} · test samples per task {esc(m.get('test_counts'))} · evaluated on "
            f"{esc(m.get('evaluated_on', 'test'))}</p>")
    metric_rows = "".join(
        f'<tr><td class="l">{esc(k)}{f" ({M.MCITLIB[k]})" if k in M.MCITLIB else ""}</td>{num(k, m.get(k))}'
        f'<td class="l small">{esc(DESCRIPTIONS[k])}</td></tr>' for k in M.FINAL_METRICS if k in m)
    metrics = (f'<h2>Metrics</h2><table class="metrics"><thead><tr><th class="l">metric</th><th>value (%)</th>'
               f'<th class="l">what it is</th></tr></thead><tbody>{metric_rows}</tbody></table>')
    cols = "".join(f"<th>{esc(t)}</th>" for t in tasks)
    body_rows = []
    if zs is not None:
        body_rows.append('<tr data-row="zero_shot"><td class="l">zero-shot</td>'
                         + "".join(num(f"zero_shot.{i}", v) for i, v in enumerate(zs)) + "</tr>")
    for t, row in enumerate(acc):
        body_rows.append(f'<tr data-row="{t}"><td class="l">after {esc(rows[t])}</td>'
                         + "".join(num(f"acc_matrix.{t}.{i}", v) for i, v in enumerate(row)) + "</tr>")
    matrix = (f'<h2>Accuracy matrix (%)</h2><p class="small">rows: after training each task; columns: the task '
              f'evaluated</p><table class="acc"><thead><tr><th class="l">after \\ on</th>{cols}</tr></thead><tbody>'
              + "".join(body_rows) + "</tbody></table>")
    figs = ('<div class="figs">' + heatmap_svg(tasks, acc, [f"after {r}" for r in rows[:len(acc)]], title)
            + (curves_svg(tasks, acc, zs, rows[:len(acc)]) if m.get("schedule") != "joint" else "") + "</div>")
    losses = ('<h2>Losses</h2><div class="figs">'
              + loss_svg(training_losses(run), tasks, m.get("first_task_loss") or [], rows) + "</div>")
    general = ""
    if m.get("general_ability"):
        g = m["general_ability"]
        gcols = sorted({(t, k) for res in g.values() for t, ms in res.items() for k in ms})
        general = ('<h2>General ability (lmms-eval)</h2><table class="general sortable"><thead><tr><th class="l">row'
                   "</th>" + "".join(f"<th>{esc(t)} {esc(k)}</th>" for t, k in gcols) + "</tr></thead><tbody>"
                   + "".join(f'<tr><td class="l">{esc(tag)}</td>'
                             + "".join(num(f"general.{tag}.{t}.{k}", (res.get(t) or {}).get(k), 4) for t, k in gcols)
                             + "</tr>" for tag, res in g.items()) + "</tbody></table>")
    return page(title, head + metrics + extra + matrix + figs + losses + general + forgotten_section(run, m, splits))


def write_run_html(run_dir: Path, splits: list[Any] | None = None, extra: str = "") -> Path:
    """report.html of a finished run, written atomically beside report.md."""
    path = Path(run_dir) / "report.html"
    atomic_write_text(path, run_html(run_dir, splits, extra))
    return path


# -- a sweep -----------------------------------------------------------------------------------------------------
def _cell(key: str, m: dict[str, Any]) -> str:
    """mean ± std: data-value holds the mean, data-std the std."""
    if m.get("mean") is None:
        return f'<td data-key="{esc(key)}" data-value="">n/a</td>'
    std = m.get("std")
    text = f"{m['mean']:.2f}" + (f" ± {std:.2f}" if std is not None else "")
    return (f'<td data-key="{esc(key)}" data-value="{float(m["mean"])!r}" '
            f'data-std="{"" if std is None else repr(float(std))}">{text}</td>')


def bars_svg(groups: list[dict[str, Any]], keys: Iterable[str]) -> str:
    plt = _pyplot()
    keys = list(keys)
    fig, axes = plt.subplots(1, len(keys), figsize=(3.4 * len(keys), 3.4), squeeze=False)
    labels = [f"{g['config']}" + (f"\n{g['setting_label']}" if g.get("setting_label") else "") for g in groups]
    for ax, k in zip(axes.flat, keys):
        means = [g["metrics"][k]["mean"] or 0.0 for g in groups]
        stds = [g["metrics"][k]["std"] or 0.0 for g in groups]
        ax.bar(range(len(groups)), means, yerr=stds, capsize=4, color="#4c78a8")
        ax.set_xticks(range(len(groups)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_title(k, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return svg(fig)


def sweep_html(agg: dict[str, Any], table_metrics: list[str], mcitlib_metrics: list[str], extra: str = "") -> str:
    """The page of a sweep from its aggregate (``mcit.studies.results.aggregate``)."""
    groups = [g for g in agg["groups"] if g["n"] > 0]
    keys = list(dict.fromkeys([*table_metrics, *mcitlib_metrics]))
    head = "".join(f"<th>{esc(M.MCITLIB.get(k, k))}</th>" for k in keys)
    body = "".join(
        f'<tr data-group="{n}"><td class="l">{esc(g["config"])}</td><td class="l">{esc(g["method"])}</td>'
        f'<td class="l">{esc(g["setting_label"])}</td><td data-key="n" data-value="{g["n"]}">{g["n"]}'
        + (f' <span class="bad">({g["n_failed"]} failed)</span>' if g["n_failed"] else "") + "</td>"
        + "".join(_cell(k, g["metrics"][k]) for k in keys) + "</tr>" for n, g in enumerate(agg["groups"]))
    table = (f'<h2>Mean ± std</h2><p class="small">{esc(agg["std"])} over seeds × task orders; accuracy in %; click '
             f'a column to sort.</p><table class="sweep sortable"><thead><tr><th class="l">config</th>'
             f'<th class="l">method</th><th class="l">setting</th><th>n</th>{head}</tr></thead><tbody>{body}'
             "</tbody></table>")
    figs = ""
    if groups:
        figs = '<h2>Per configuration</h2><div class="figs">' + bars_svg(groups, ("final_avg_acc", "forgetting")) \
            + "</div>"
        mats = [heatmap_svg(g["tasks"], g["acc_matrix_mean"],
                            [f"after {t}" for t in g["tasks"]][:len(g["acc_matrix_mean"])],
                            f"{g['config']} {g['setting_label']}".strip())
                for g in groups if g.get("acc_matrix_mean")]
        figs += '<h2>Mean accuracy matrices</h2><div class="figs">' + "".join(mats) + "</div>"
    failed = ""
    if agg.get("failed"):
        failed = ('<h2>Points that did not finish</h2><table><thead><tr><th class="l">point</th><th class="l">reason'
                  '</th></tr></thead><tbody>' + "".join(f'<tr><td class="l">{esc(f["point"])}</td><td class="l">'
                                                         f'{esc(f["reason"])}</td></tr>' for f in agg["failed"])
                  + "</tbody></table>")
    title = f"Sweep {agg['sweep']}"
    return page(title, f"<h1>{esc(title)}</h1>" + table + extra + figs + failed)



# -- a study -----------------------------------------------------------------------------------------------------
def png_img(path: Path, alt: str) -> str:
    """A PNG file as an inline ``data:`` image."""
    return f'<img alt="{esc(alt)}" src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}">'


def study_html(title: str, sections: list[tuple[str, list[dict[str, Any]], set[int]]], columns: list[str],
               images: list[Path], extra: str = "") -> str:
    """The page of a study (``mcit.studies.study.write_study``): per section (heading, rows as ``rows_of`` gives
    them, the ids of the chosen rows), a sortable mean ± std table; then the study's figures, inlined."""
    parts = [f"<h1>{esc(title)}</h1>"]
    for heading, rows, chosen in sections:
        head = "".join(f"<th>{esc(c)}</th>" for c in columns)
        body = "".join(
            f'<tr><td class="l">{esc(r["config"])}</td><td class="l">{esc(r["label"])}'
            + (' <b class="good">(chosen)</b>' if id(r) in chosen else "") + "</td>"
            f'<td data-key="n" data-value="{r["n"]}">{r["n"]}</td>'
            + "".join(_cell(c, r["metrics"].get(c) or {"mean": None}) for c in columns) + "</tr>" for r in rows)
        parts.append(f'<h2>{esc(heading)}</h2><table class="study sortable"><thead><tr><th class="l">config</th>'
                     f'<th class="l">setting</th><th>n</th>{head}</tr></thead><tbody>{body}</tbody></table>')
    parts.append(extra)
    if images:
        parts.append('<h2>Figures</h2><div class="figs">' + "".join(png_img(p, p.stem) for p in images) + "</div>")
    return page(title, "".join(parts))


# -- published numbers -------------------------------------------------------------------------------------------
def published_html(pairs: list[tuple[Any, dict[str, Any]]]) -> str:
    """The published / ours / Δ table (``mcit.studies.published.compare``'s pairs), sortable."""
    if not pairs:
        return ""
    body = "".join(
        f'<tr><td class="l">{esc(r.paper)}{f" (arXiv {esc(r.arxiv)})" if r.arxiv else ""}</td>'
        f'<td class="l">{esc(r.table)}</td><td class="l">{esc(r.setting)}</td><td class="l">{esc(r.method)}</td>'
        f'<td class="l">{esc(r.metric)}</td>{num("published", r.value)}{num("ours", o["mean"])}'
        f'{num("delta", None if o["mean"] is None else o["mean"] - r.value)}'
        f'<td class="l small">{esc(r.where)}</td></tr>'
        for r, o in pairs)
    return ('<h2>Published numbers beside ours</h2><p class="small">Δ = ours − published (percentage points)</p>'
            '<table class="published sortable"><thead><tr><th class="l">paper</th><th class="l">table</th>'
            '<th class="l">setting</th><th class="l">method</th><th class="l">metric</th><th>published</th>'
            f'<th>ours</th><th>Δ</th><th class="l">where</th></tr></thead><tbody>{body}</tbody></table>')
