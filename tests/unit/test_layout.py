"""The package's import direction: data <- train <- evaluate; plan needs only the model shape; nothing imports
the CLI (cli.py and its options.py). Read from the source (every import, also those inside functions), so a
cycle cannot creep back in."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pipeline"
# What each part may import besides itself; the shared leaves (errors, atomic, progress, model) are open to all.
LEAVES = {"pipeline", "pipeline.errors", "pipeline.atomic", "pipeline.progress", "pipeline.units", "pipeline.model"}
ALLOWED = {
    "data": set(),
    "plan": set(),
    "train": {"data", "plan"},
    "evaluate": {"data", "train", "plan"},
    "model": set(),
    "doctor": {"train", "plan"},
}


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
                name in ("pipeline.cli", "pipeline.__main__", "pipeline.launch", "pipeline.pretrain")
                or target in LEAVES
                or target.startswith("pipeline.model")
            ):
                continue
            own, other = _part(name), _part(target)
            if other != own and other not in ALLOWED.get(own, set()):
                bad.append(f"{name} imports {target}")
    assert not bad, "imports against the direction data <- train <- evaluate, plan <- model:\n" + "\n".join(bad)


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
        "launch.py",
        "options.py",
        "pretrain.py",
        "progress.py",
        "units.py",
    ]
