"""pipeline.atomic's guarantees under an interrupt: the steps that must not be split (`uninterrupted`) finish before
a Ctrl-C or SIGTERM is raised, and a folder written whole (`replacing_dir`) is the earlier one or the new one,
its lock and temporary folder gone, wherever the interrupt lands. The same through real processes and signals, for
every writing command: tests/unit/test_writers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import pipeline.atomic as atomic
from pipeline.atomic import interrupt, replacing_dir, uninterrupted


def test_an_interrupt_inside_uninterrupted_steps_is_raised_when_they_end() -> None:
    done = []
    with pytest.raises(KeyboardInterrupt):
        with uninterrupted():
            interrupt(KeyboardInterrupt())
            done.append("after the signal")
            with uninterrupted():  # nested: raised at the outermost end only
                interrupt(KeyboardInterrupt())
                done.append("inner")
            done.append("outer end")
    assert done == ["after the signal", "inner", "outer end"]
    with pytest.raises(KeyboardInterrupt):
        interrupt(KeyboardInterrupt())  # outside: at once
    with uninterrupted():  # nothing deferred is left over for the next steps
        pass


def test_a_folder_written_whole_is_the_earlier_or_the_new_wherever_an_interrupt_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interrupt arrives in the lock's taking, in the temporary folder's making, while the output is written, and
    in the final renames: each leaves the earlier folder (or, in the renames, the new one) and nothing beside it."""
    target = tmp_path / "out"
    with replacing_dir(target) as work:
        (work / "f").write_text("earlier")

    real_acquire, real_mkdir, real_replace = atomic.OneWriter._acquire, Path.mkdir, atomic.os.replace

    def acquire_then_signal(self: atomic.OneWriter) -> None:
        real_acquire(self)
        interrupt(KeyboardInterrupt())

    def mkdir_then_signal(self: Path, *a: object, **k: object) -> None:
        real_mkdir(self, *a, **k)  # type: ignore[arg-type]
        if self.name.endswith(".tmp"):
            interrupt(KeyboardInterrupt())

    def replace_then_signal(src: object, dst: object) -> None:
        real_replace(src, dst)  # type: ignore[arg-type]
        interrupt(KeyboardInterrupt())

    for where, patch, expect in (
        ("acquire", lambda: monkeypatch.setattr(atomic.OneWriter, "_acquire", acquire_then_signal), "earlier"),
        ("mkdir", lambda: monkeypatch.setattr(Path, "mkdir", mkdir_then_signal), "earlier"),
        ("renames", lambda: monkeypatch.setattr(atomic.os, "replace", replace_then_signal), "new"),
    ):
        patch()
        with pytest.raises(KeyboardInterrupt):
            with replacing_dir(target) as work:
                (work / "f").write_text("new")
        monkeypatch.undo()
        assert (target / "f").read_text() == expect, where
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], where
        with replacing_dir(target) as work:  # back to the earlier one for the next case
            (work / "f").write_text("earlier")

    with pytest.raises(KeyboardInterrupt):  # while the caller writes: the earlier folder, whole
        with replacing_dir(target) as work:
            (work / "f").write_text("half")
            raise KeyboardInterrupt
    assert (target / "f").read_text() == "earlier" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
