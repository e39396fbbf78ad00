"""Every command the README shows names something that exists and starts: modules and scripts answer
``--help``, console commands are the project's own entry points, make targets are in the Makefile, job
scripts parse. (What the commands then do is the launch tests' and the demo's business; this catches a README
left behind by a move, as the rooms refactor would have left ``python -m mcit.report``.)"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import tomllib
from conftest import ROOT

COMMAND = re.compile(
    r"python -m ([\w.]+)"  # a module
    r"|python ([\w/]+\.py)"  # a script
    r"|(?:deepspeed|torchrun|srun)[^`\n]*? ([\w/]+\.py)"  # a script under a launcher
    r"|(?<![\w#/-])(mcit-[a-z]+)(?![\w-])"  # a console command
    r"|make ([a-z][\w-]*)"  # a make target
    r"|sbatch[^`\n]*? ([\w/]+\.sbatch)")  # a job script


def commands(text: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {k: set() for k in ("module", "script", "console", "make", "sbatch")}
    for m in COMMAND.finditer(text):
        module, script, launched, console, make, sbatch = m.groups()
        for kind, value in (("module", module), ("script", script or launched), ("console", console),
                            ("make", make), ("sbatch", sbatch)):
            if value:
                out[kind].add(value)
    return out


def _help(argv: list[str]) -> tuple[list[str], int, str]:
    res = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return argv, res.returncode, res.stderr[-500:]


def problems(found: dict[str, set[str]]) -> list[str]:
    """What in ``found`` does not exist or does not start."""
    bad = []
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name in sorted(found["console"]):
        if name not in scripts:
            bad.append(f"{name}: not a console command of pyproject.toml")
            continue
        mod, _, fn = scripts[name].partition(":")
        if not callable(getattr(importlib.import_module(mod), fn, None)):
            bad.append(f"{name}: {scripts[name]} is not a function")
    targets = set(re.findall(r"^([a-z][\w-]*)\s*:", (ROOT / "Makefile").read_text(), re.M))
    bad += [f"make {t}: no such target" for t in sorted(found["make"] - targets)]
    for job in sorted(found["sbatch"]):
        res = subprocess.run(["bash", "-n", str(ROOT / job)], capture_output=True, text=True)
        if not (ROOT / job).is_file() or res.returncode:
            bad.append(f"{job}: missing or not valid bash")
    runs = []
    for mod in sorted(found["module"]):
        if importlib.util.find_spec(mod.split(".")[0]) is None or importlib.util.find_spec(mod) is None:
            bad.append(f"python -m {mod}: no such module")
        else:
            runs.append(["-m", mod])
    for path in sorted(found["script"]):
        if not (ROOT / path).is_file():
            bad.append(f"{path}: no such script")
        else:
            runs.append([path])
    with ThreadPoolExecutor(2) as pool:
        for argv, rc, err in pool.map(_help, runs):
            if rc != 0:
                bad.append(f"python {' '.join(argv)} --help: exit {rc}: {err.strip().splitlines()[-1:]}")
    return bad


def test_every_readme_command_exists_and_starts():
    found = commands((ROOT / "README.md").read_text())
    assert {"mcit-run", "mcit-evaluate", "mcit-sweep", "mcit-report"} <= found["console"]
    assert {"demo", "test"} <= found["make"] and "pipelines/run_task_sequence.py" in found["script"]
    assert problems(found) == []


def test_the_check_catches_a_stale_command():
    text = ("`python -m mcit.report runs/x` · `mcit-reprot` · `make demo-all` · `python pipelines/evaluate_all.py` · "
            "`sbatch pipelines/slurm/none.sbatch` · [x](#mcit-what-it-shows)")
    found = commands(text)
    assert found["console"] == {"mcit-reprot"}  # an anchor is not a command
    assert problems(found) == ["mcit-reprot: not a console command of pyproject.toml", "make demo-all: no such target",
                               "pipelines/slurm/none.sbatch: missing or not valid bash",
                               "python -m mcit.report: no such module", "pipelines/evaluate_all.py: no such script"]


def test_a_program_that_fails_to_start_is_reported(tmp_path, monkeypatch):
    """A module that exists but dies on ``--help`` (an import error after a move) is a problem too."""
    broken = tmp_path / "broken_cli.py"
    broken.write_text("import mcit.no_such_room\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    found = {"module": {"broken_cli"}, "script": set(), "console": set(), "make": set(), "sbatch": set()}
    bad = problems(found)
    assert len(bad) == 1 and bad[0].startswith("python -m broken_cli --help: exit 1"), bad


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_docs_commands_exist_and_links_resolve():
    """The pages the README links to (docs/*.md) name commands that exist too, and every relative link of the
    README and of those pages reaches a file and, with an anchor, one of its headings (sections moved between the
    README and docs/ keep their links)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found: dict[str, set[str]] = {k: set() for k in ("module", "script", "console", "make", "sbatch")}
    readme = commands(pages[0].read_text())  # started by the test above
    for page in pages[1:]:
        for k, v in commands(page.read_text()).items():
            found[k] |= {x for x in v if not x.endswith(".")} - readme[k]  # `python -m data_prep.<name>`: a placeholder
    assert problems(found) == []
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target}: no such file")
            elif anchor and dest.suffix == ".md":
                heads = {_slug(h) for h in re.findall(r"(?m)^#+ (.+)$", dest.read_text())}
                if anchor not in heads:
                    broken.append(f"{page.name}: {target}: no such heading")
    assert broken == []


def test_the_layout_section_is_in_step_with_the_tree():
    """The README's Layout names every top-level folder, every module of mcit/'s rooms and every page of docs/."""
    text = (ROOT / "README.md").read_text()
    layout = text[text.index("## Layout"):]
    layout = layout[layout.index("```") + 3:]
    layout = layout[:layout.index("```")]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    folders = {p.split("/")[0] for p in tracked if "/" in p and not p.startswith(".")}
    missing = [f"{d}/" for d in sorted(folders) if not re.search(rf"(?m)^{re.escape(d)}/", layout)]
    modules = {p.split("/")[-1][:-3] for p in tracked if re.match(r"mcit/\w+/\w+\.py$", p)} - {"__init__"}
    missing += [f"mcit module {m}" for m in sorted(modules) if not re.search(rf"\b{m}\b", layout)]
    docs = {p.split("/")[-1] for p in tracked if re.match(r"docs/[^/]+\.md$", p)}
    missing += [f"docs/{d}" for d in sorted(docs) if d not in layout]
    assert missing == []
