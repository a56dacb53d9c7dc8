"""pipeline.fields: what a config field says of itself, read from its declaration (its docstring, its Annotated
markers, its Literal), and the checks made from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pipeline.fields import Range, Size, field_docs, field_problems, fields_of
from pipeline.train.setup.config import OptimSection, unannotated


def test_a_range_says_itself_in_words() -> None:
    assert Range(1).says() == "1 or more"
    assert Range(None, 5).says() == "at most 5"
    assert Range(300, 1_000_000).says() == "from 300 to 1,000,000"
    assert Range(0.0, 1.0, open_low=True).says() == "above 0 and at most 1"
    assert Range(0.0, 1.0, open_low=True, open_high=True).says() == "above 0 and below 1"
    assert Range(0.0, 1.0, open_high=True).says() == "at least 0 and below 1" and not Range(
        0.0, 1.0, open_high=True
    ).holds(1.0)


def test_each_problem_is_named_with_its_field_and_every_one_at_once() -> None:
    @dataclass(frozen=True)
    class Stage:
        depth: Annotated[int, Range(1, 8)] = 2
        """How deep."""
        mode: Literal["fast", "exact"] = "exact"
        """How."""
        sizes: tuple[Literal["s", "m"], ...] = ()
        budget: Annotated[int | None, Size("1MB"), Range(1)] = None
        """Not given: no check."""

    problems = field_problems(Stage(depth=0, mode="slow", sizes=("s", "xl")))  # type: ignore[arg-type]
    assert problems == [
        "--depth 0: expected from 1 to 8 (default 2)",
        "--mode slow: expected fast or exact",
        "--sizes xl: expected s or m",
    ]
    assert field_problems(Stage(depth=9), prefix="stage") == ["stage.depth 9: expected from 1 to 8 (default 2)"]
    assert field_docs(Stage) == {"depth": "How deep.", "mode": "How.", "budget": "Not given: no check."}
    assert [f.flag for f in fields_of(Stage)] == ["--depth", "--mode", "--sizes", "--budget"]


def test_a_config_files_fields_read_their_type_through_the_markers() -> None:
    """The pretrain config reads a YAML value as the field's type whatever markers the field carries."""
    assert unannotated("Annotated[int | None, Range(1)]") == "int | None"
    assert unannotated("Annotated[float, Range(0.0, 1.0, open_low=True, open_high=True)]") == "float"
    assert unannotated("Literal['a', 'b']") == "Literal['a', 'b']"
    assert OptimSection(lr=0.5, min_lr=0.6).problems() == ["optim.min_lr 0.6: expected 0 <= min_lr <= lr (0.5)"]
