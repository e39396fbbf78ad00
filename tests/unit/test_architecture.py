"""The house plan (docs/architecture.md), enforced: which rooms may import which, no module reaching into
another's private names, every hook the pipeline and the evaluator call declared on Method, declared (not
detected) stages, and a design document whose "how to add" sections each name one file."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import ROOT

# Rooms from the bottom up, one folder of mcit/ each: a module may import its own room and the rooms below it,
# never one above. The rooms are the folders (``rooms_of``); this list only orders them, and a folder it does not
# order, or a module outside every folder, fails.
ORDER = ("core", "data", "models", "methods", "run", "studies", "cli")


def rooms_of(package: Path = ROOT / "mcit") -> list[str]:
    """The package's rooms: its sub-folders that are packages, in ORDER."""
    found = {d.name for d in package.iterdir() if (d / "__init__.py").is_file()}
    assert found <= set(ORDER), f"mcit/{sorted(found - set(ORDER))} is a folder ORDER does not place"
    return [r for r in ORDER if r in found]


def _module_name(path: Path, base: Path = ROOT) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _room(module: str, rooms: list[str] | None = None) -> int:
    """The room of ``mcit.<room>.<...>``; the package itself (``mcit``, side-effect free) is below every room."""
    rooms = rooms if rooms is not None else list(ORDER)
    parts = module.split(".")
    if parts == ["mcit"]:
        return -1
    assert len(parts) >= 2 and parts[1] in rooms, \
        f"{module} is in no room: every module lives in one of mcit/{{{','.join(rooms)}}}/ (docs/architecture.md)"
    return rooms.index(parts[1])


def project_imports(path: Path) -> set[str]:
    """Every mcit module ``path`` imports, at the top or inside functions (``from mcit import x`` -> mcit.x)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mcit" and node.level == 0:
            if node.module == "mcit":
                out |= {f"mcit.{a.name}" for a in node.names}
            else:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "mcit"}
    return out


def import_violations(package: Path = ROOT / "mcit") -> list[str]:
    rooms = rooms_of(package)
    bad = []
    for f in sorted(package.rglob("*.py")):
        me = _module_name(f, package.parent)
        _room(me, rooms)  # every module is in a room, whatever it imports
        for dep in sorted(project_imports(f)):
            if _room(dep, rooms) > _room(me, rooms):
                bad.append(f"{me} ({rooms[_room(me, rooms)]}) imports {dep} ({rooms[_room(dep, rooms)]})")
    return bad


def longest_chain(package: Path = ROOT / "mcit", room: str = "run") -> list[str]:
    """The longest import chain inside one room (modules, the importer first), imports inside functions
    included: how many floors the room has."""
    mods = {_module_name(f, package.parent): f for f in sorted((package / room).glob("*.py")) if f.stem != "__init__"}
    deps = {m: sorted(d for d in project_imports(f) if d in mods and d != m) for m, f in mods.items()}
    memo: dict[str, list[str]] = {}

    def chain(m: str, seen: tuple[str, ...] = ()) -> list[str]:
        assert m not in seen, f"import cycle: {' -> '.join((*seen, m))}"
        if m not in memo:
            memo[m] = [m] + max((chain(d, (*seen, m)) for d in deps[m]), key=len, default=[])
        return memo[m]

    return max((chain(m) for m in mods), key=len, default=[])


def test_lower_rooms_never_import_upper_ones():
    assert rooms_of() == list(ORDER)
    assert import_violations() == []
    for f in [*(ROOT / "mcit" / "data").rglob("*.py"), *(ROOT / "mcit" / "models").rglob("*.py")]:
        forbidden = {d for d in project_imports(f) if d.startswith(("mcit.methods", "mcit.run", "mcit.cli"))}
        assert not forbidden, f"{f.relative_to(ROOT)} imports {sorted(forbidden)}"


def test_every_module_is_in_a_room_folder():
    """No catch-all: a module directly under mcit/ (other than the package's own __init__) is in no room."""
    flat = [f.name for f in (ROOT / "mcit").glob("*.py") if f.name != "__init__.py"]
    assert flat == []
    for f in (ROOT / "mcit").rglob("*.py"):
        _room(_module_name(f))  # asserts


def test_the_running_room_has_at_most_three_floors():
    chain = longest_chain()
    assert len(chain) <= 3, " -> ".join(chain)


def test_the_rule_catches_an_upward_import(tmp_path):
    """The check itself, on a copy of the package with one upward import added (lazily, inside a function)."""
    import shutil

    shutil.copytree(ROOT / "mcit", tmp_path / "mcit", ignore=shutil.ignore_patterns("__pycache__"))
    assert import_violations(tmp_path / "mcit") == []
    (tmp_path / "mcit" / "data" / "probe.py").write_text("def f():\n    from mcit.run.pipeline import Pipeline\n")
    assert import_violations(tmp_path / "mcit") == ["mcit.data.probe (data) imports mcit.run.pipeline (run)"]
    (tmp_path / "mcit" / "data" / "probe.py").unlink()
    (tmp_path / "mcit" / "helpers.py").write_text("X = 1\n")  # a flat module: in no room
    with pytest.raises(AssertionError, match="mcit.helpers is in no room"):
        import_violations(tmp_path / "mcit")
    (tmp_path / "mcit" / "helpers.py").unlink()
    (tmp_path / "mcit" / "extras").mkdir()  # a folder the order does not place
    (tmp_path / "mcit" / "extras" / "__init__.py").write_text("")
    with pytest.raises(AssertionError, match="extras"):
        import_violations(tmp_path / "mcit")


def test_the_floor_count_catches_a_fourth_floor(tmp_path):
    """A copy of the package where the evaluator imports the method host again (evaluation -> lifecycle ->
    plan -> ...): the pipeline on top makes four floors."""
    import shutil

    shutil.copytree(ROOT / "mcit", tmp_path / "mcit", ignore=shutil.ignore_patterns("__pycache__"))
    assert len(longest_chain(tmp_path / "mcit")) <= 3
    ev = tmp_path / "mcit" / "run" / "evaluation.py"
    ev.write_text(ev.read_text() + "\n\ndef _host():\n    from mcit.run.lifecycle import MethodHost\n")
    chain = longest_chain(tmp_path / "mcit")
    assert len(chain) == 4 and chain[1:3] == ["mcit.run.evaluation", "mcit.run.lifecycle"], chain


PROJECT_DIRS = ("mcit", "pipelines", "data_prep", "bench", "tests")


def _private_names_defined() -> set[str]:
    """Underscore names the project defines: functions, classes, attributes, module variables."""
    names = set()
    for d in PROJECT_DIRS:
        for f in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_reach(source: str, private: set[str]) -> list[str]:
    """``from m import _x`` of a project module, and ``obj._x`` on anything but self / cls / super() or a name
    imported from another package (a library's privacy is not this rule's: a family reusing transformers' own
    helper instead of copying it is what the project wants)."""
    bad = []
    project = ("mcit", "pipelines", "data_prep", "conftest", "raw_formats")
    foreign = {a.asname or a.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
               and node.module and node.level == 0 and node.module.split(".")[0] not in project for a in node.names}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                node.module.split(".")[0] in ("mcit", "pipelines", "data_prep", "conftest", "raw_formats"):
            bad += [f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
        if isinstance(node, ast.Attribute) and node.attr in private:
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls", *foreign):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            bad.append(f"line {node.lineno}: {ast.unparse(node)}")
    return bad


def test_no_module_reaches_into_another_modules_private_names():
    private = _private_names_defined()
    bad = {}
    for d in PROJECT_DIRS:
        for f in sorted((ROOT / d).rglob("*.py")):
            found = private_reach(f.read_text(), private)
            if found:
                bad[str(f.relative_to(ROOT))] = found
    assert bad == {}


def test_the_private_name_rule_catches_both_forms():
    private = {"_eval_row", "_master"}
    src = "from mcit.run.engine import _master\npipe._eval_row(1)\nself._eval_row(2)\nsuper()._eval_row(3)\n"
    assert private_reach(src, private) == ["line 1: from mcit.run.engine import _master", "line 2: pipe._eval_row"]
    lib = "from transformers import Proc\nfrom mcit.run import engine\nProc._eval_row(1)\nengine._master\n"
    assert private_reach(lib, private) == ["line 4: engine._master"]


def _hook_calls() -> dict[str, set[str]]:
    """Attributes the pipeline, the lifecycle driver, the engine, the subspace protocol and the evaluator
    use on a method object (a variable or attribute named ``method``, or DeepSpeed's ``engine.module``)."""
    files = ["mcit/run/pipeline.py", "mcit/run/lifecycle.py", "mcit/run/engine.py", "mcit/run/subspace_stage.py",
             "mcit/run/evaluation.py", "mcit/run/evaluate_only.py"]
    out: dict[str, set[str]] = {}
    for rel in files:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.Attribute):
                v = node.value
                # cfg.method: the config section
                of_config = isinstance(v, ast.Attribute) and "cfg" in ast.unparse(v.value)
                if (isinstance(v, ast.Name) and v.id == "method") or \
                        (isinstance(v, ast.Attribute) and v.attr in ("method", "module") and not of_config):
                    out.setdefault(node.attr, set()).add(rel)
    return out


def test_every_hook_the_pipeline_and_evaluator_call_is_declared_on_method():
    from torch import nn

    from mcit.methods.base import Method

    calls = _hook_calls()
    assert {"set_task", "set_phase", "before_task", "after_task", "statistics", "finalize_statistics",
            "subspace_report", "predict", "generate", "task_loss", "zero_shot", "project_update",
            "has_subspace_stage", "projects_updates", "phase_train", "trainable_parameters"} <= set(calls)
    for name, where in sorted(calls.items()):
        if name in nn.Module.__dict__ or name in ("backbone", "name"):
            continue  # nn.Module's own (to, state_dict, ...) and the two plain attributes every method has
        assert name in Method.__dict__, f"{sorted(where)} use method.{name}, which Method does not declare"
        attr = Method.__dict__[name]
        if callable(attr) or isinstance(attr, (classmethod, staticmethod)):
            doc = (getattr(attr, "__func__", attr).__doc__ or "").strip()
            assert doc, f"Method.{name} has no docstring"


def test_stages_are_declared_and_the_declarations_are_true():
    """has_subspace_stage / projects_updates are class attributes, never found by introspection in the
    pipeline; each shipped method declares exactly what it implements."""
    from mcit.core.registry import METHODS
    from mcit.methods.base import Method

    for f in ("mcit/run/pipeline.py", "mcit/run/lifecycle.py", "mcit/run/engine.py"):
        assert "is not Method." not in (ROOT / f).read_text()
    for name in METHODS.names():
        cls = METHODS.get(name)
        if not cls.__module__.startswith("mcit."):
            continue
        overrides = {h for h in ("statistics", "project_update", "answer_tokens")
                     if any(h in k.__dict__ for k in cls.__mro__ if k not in (Method, object))}
        assert cls.has_subspace_stage == ("statistics" in overrides), name
        assert cls.projects_updates == ("project_update" in overrides), name
        assert cls.token_loss == ("answer_tokens" in overrides), name


def _architecture() -> str:
    path = ROOT / "docs" / "architecture.md"
    assert path.is_file(), "docs/architecture.md is the project's design document"
    return path.read_text()


@pytest.mark.parametrize("what", ["method", "backbone", "scorer", "dataset converter"])
def test_every_how_to_add_names_one_file(what):
    text = _architecture()
    m = re.search(rf"^### Adding a {what}\n(.*?)(?=^##)", text, re.S | re.M)
    assert m, f"docs/architecture.md has no section '### Adding a {what}'"
    files = re.findall(r"^File: `([^`]+)`", m.group(1), re.M)
    assert len(files) == 1, f"'Adding a {what}' must name exactly one file, names {files}"
    assert "No other file changes" in m.group(1)


def test_the_design_document_covers_the_plan_and_the_code_points_to_it():
    text = _architecture()
    for heading in ("## Rooms", "## The stage loop", "## The method interface", "## One batch",
                    "## How to add", "## Known faults of the official code"):
        assert heading in text, heading
    for f in sorted((ROOT / "mcit").rglob("*.py")):
        rel = f.relative_to(ROOT)
        if f.name != "__init__.py" and rel.parts[1] in ("core", "run", "studies", "cli"):
            assert f"`{rel.parent}/`" in text and f"`{f.name}`" in text, (
                f"{rel} is not described in docs/architecture.md")
    stale = [str(f.relative_to(ROOT)) for d in ("mcit", "pipelines", "data_prep") for f in (ROOT / d).rglob("*.py")
             if "DESIGN.md" in f.read_text()]
    assert stale == []


def test_sources_compile_without_warnings():
    """Invalid escapes in non-raw strings are a SyntaxWarning on Python 3.12 (the GPU image's), a
    DeprecationWarning on 3.11, and a SyntaxError in some future Python: none may be left."""
    import warnings

    bad = []
    for path in sorted(p for d in ("mcit", "pipelines", "data_prep", "bench", "tests")
                       for p in (ROOT / d).rglob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(path.read_text(), str(path), "exec")
            except (SyntaxError, SyntaxWarning, DeprecationWarning) as e:
                bad.append(f"{path.relative_to(ROOT)}: {e}")
    assert not bad, bad
