"""The package's import direction: data <- train <- evaluate; plan needs only the model shape; launch uses the
stages and nothing but the CLI uses launch; nothing imports the CLI (cli.py and its options.py). Inside train/,
its components point down: runtime/ <- setup/ <- checkpoint/ <- parts/ <- the loop's own modules. Read from the
source (every import, also those inside functions), so a cycle cannot creep back in."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pipeline"
# What each part may import besides itself; the shared leaves (errors, atomic, progress, units, fields, model) are
# open to all.
LEAVES = {
    "pipeline",
    "pipeline.errors",
    "pipeline.atomic",
    "pipeline.progress",
    "pipeline.units",
    "pipeline.fields",
    "pipeline.model",
}
ALLOWED = {
    "data": set(),
    "plan": set(),
    "train": {"data", "plan"},
    "evaluate": {"data", "train", "plan"},
    "model": set(),
    "doctor": {"train", "plan"},
    "launch": {"data", "train", "evaluate", "plan", "doctor"},
}
# train/'s components, bottom first: each may import its own and those below it. The top (the loop and what only it
# uses) may import all. The leaves (the run's position, the fault hooks, one step) sit just above runtime/: open to
# every component but runtime/, and importing only runtime/ and each other.
TRAIN_FLOORS = ["runtime", "setup", "checkpoint", "parts"]
TRAIN_LEAVES = {"state", "faults", "step"}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "pipeline":
                found |= {
                    f"pipeline.{a.name}" if (PKG / f"{a.name}.py").exists() or (PKG / a.name).is_dir() else "pipeline"
                    for a in node.names
                }  # a submodule, or a name such as __version__
            elif node.module.startswith("pipeline."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pipeline.")}
    return found


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__")


def test_imports_point_one_way() -> None:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        name = _module_name(path)
        for target in _imports(path):
            if target in ("pipeline.cli", "pipeline.options") and name not in ("pipeline.cli", "pipeline.__main__"):
                bad.append(f"{name} imports the CLI")
                continue
            if (
                name in ("pipeline.cli", "pipeline.__main__", "pipeline.pretrain")
                or target in LEAVES
                or target.startswith("pipeline.model")
            ):
                continue
            own, other = _part(name), _part(target)
            if other != own and other not in ALLOWED.get(own, set()):
                bad.append(f"{name} imports {target}")
    assert not bad, "imports against the direction data <- train <- evaluate, plan <- model:\n" + "\n".join(bad)


def _train_floor(module: str) -> float:
    """A module of train/'s floor: its component's index, a leaf 0.5, the top (main, loop, engine, ...) the last."""
    parts = module.split(".")
    if parts[2] in TRAIN_LEAVES:
        return 0.5
    return TRAIN_FLOORS.index(parts[2]) if parts[2] in TRAIN_FLOORS else len(TRAIN_FLOORS)


def test_train_components_point_down() -> None:
    bad = []
    modules = [p for p in sorted((PKG / "train").rglob("*.py")) if p.name != "__init__.py"]
    for path in modules:
        name = _module_name(path)
        for target in _imports(path):
            if target.startswith("pipeline.train.") and _train_floor(target) > _train_floor(name):
                bad.append(f"{name} imports {target}")
    assert not bad, "train/ imports pointing up (runtime <- setup <- checkpoint <- parts <- the loop):\n" + "\n".join(
        bad
    )
    # every module is in a component or named on top: a new file is placed on purpose
    top = sorted(p.stem for p in (PKG / "train").glob("*.py") if p.stem != "__init__")
    # the loop's modules, and the forecasts of `pipeline plan --config/--from-run` (forecast, forecast_report and
    # measured_slices: what the planner says of a config or run, which needs the config and runs of train/)
    assert top == [
        "engine",
        "faults",
        "forecast",
        "forecast_report",
        "loop",
        "main",
        "measured_slices",
        "preflight",
        "state",
        "step",
    ]
    assert sorted(p.name for p in (PKG / "train").iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        TRAIN_FLOORS
    )


def test_the_layout_is_by_stage() -> None:
    for part in ALLOWED:
        assert (PKG / part / "__init__.py").exists()
    flat = sorted(p.name for p in PKG.glob("*.py"))
    assert flat == [
        "__init__.py",
        "__main__.py",
        "atomic.py",
        "cli.py",
        "errors.py",
        "fields.py",
        "options.py",
        "pretrain.py",
        "progress.py",
        "units.py",
    ]


LONG_MODULE = 400
"""Lines past which a module is usually doing more than one job (../STYLE.md)."""


def test_a_long_module_says_why_it_is_one_job() -> None:
    """A module past LONG_MODULE lines says in its docstring what its one job is (a line beginning "One job"), so a
    reader can tell a long module that is one thing from one that should be split."""
    unsaid = []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > LONG_MODULE:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if not any(line.startswith("One job") for line in doc.splitlines()):
                unsaid.append(f"{path.relative_to(PKG.parent)} ({text.count(chr(10))} lines)")
    assert not unsaid, "long modules that do not say their one job:\n" + "\n".join(unsaid)


TESTS = PKG.parent / "tests" / "unit"
ACROSS = {
    "bad_input",
    "docs",
    "layout",
    "one_writer",
    "os_refusals",
    "paths",
    "peer_lost",
    "repeats",
    "sealed",
    "writers",
}
"""The unit tests of a class of behaviour that every stage shares (a mistake's one-line error, one live writer, a
full disk, a path's spelling, a repeat in a list, a sealed file, a peer lost), kept at tests/unit/'s top: each
sweeps every stage the class applies to."""


def test_the_unit_tests_mirror_the_package() -> None:
    """tests/unit/ has the package's folders: tests/unit/DIR/test_NAME.py tests pipeline/DIR/NAME.py (or the
    package DIR itself, or NAME_SOMETHING: one aspect of NAME, such as plan/test_memory_graphs.py), so a module's
    tests are where a reader looks for them."""
    stray = []
    for path in sorted(TESTS.rglob("test_*.py")):
        folder = path.parent.relative_to(TESTS)
        name = path.stem[len("test_") :]
        if folder == Path("."):
            ok = name in ACROSS or (PKG / f"{name}.py").exists()
        else:
            where = PKG / folder
            modules = {p.stem for p in where.glob("*.py") if p.stem != "__init__"} | {where.name}
            ok = where.is_dir() and any(name == m or name.startswith(m + "_") for m in modules)
        if not ok:
            stray.append(str(path.relative_to(TESTS)))
    assert not stray, "unit tests that name no module of their folder (move or rename them):\n" + "\n".join(stray)


AGREEMENTS = {
    "data/test_tokenizer.py": {"evaluate"},  # the tokenizer a shard records is the one an export writes
    "data/test_vocab.py": {"train"},  # an extended model folder is one the trainer's preflight takes
    "model/test_families.py": {"data", "train"},  # a family's config builds the model the trainer prepares
    "model/test_kernels.py": {"plan", "train"},  # each switch's measured effect is what the planner prices
    "model/test_varlen.py": {"data"},  # the positions a whole-document shard holds keep documents apart
    "plan/test_ds_json.py": {"train"},  # the JSON the planner writes is one the trainer accepts
    "plan/test_probe_slices.py": {"launch", "train"},  # the slices the probe runs are the config's own
    "plan/test_search.py": {"train"},  # the search never proposes what the trainer refuses
}
"""Unit tests of a component that also read the one above it, because what they hold is an agreement between
the two (what the planner prices, the trainer runs). No other reaches up."""


def test_a_components_tests_import_what_the_component_may() -> None:
    """The import direction holds for tests too: tests/unit/data/ tests data/ with the shared leaves and the CLI
    that drives it, never the trainer or the planner, but for the agreements between two components named in
    AGREEMENTS; a new test that needs more is a test of the component above."""
    bad = []
    for path in sorted(TESTS.rglob("test_*.py")):
        parts = path.parent.relative_to(TESTS).parts
        if not parts:
            continue
        own = parts[0]
        for target in _imports(path):
            if (
                target in LEAVES
                or target.startswith("pipeline.model")
                or target in ("pipeline.cli", "pipeline.options")
            ):
                continue
            other = _part(target)
            agreed = AGREEMENTS.get(str(path.relative_to(TESTS)), set())
            if other != own and other not in ALLOWED.get(own, set()) | agreed:
                bad.append(f"{path.relative_to(TESTS)} imports {target}")
    assert not bad, "tests importing against the direction data <- train <- evaluate:\n" + "\n".join(bad)
