"""What a stage's config dataclass says about each of its fields, read by both its own checks and the command line.

A field is declared once: its type (`Literal[...]` for a closed set), its default, its range or unit as an
`Annotated` marker (`Range`, `Size`, `Tokens`, ...) and, in the docstring under it, its help. `__post_init__` checks
the markers with `field_problems`; pipeline/options.py turns the same fields into the command's options, so that a
default, a choice or a range is never written a second time and a new field is a new option without a CLI edit.

Markers that say how a field is given on the command line rather than what it is (`Flag`, `Argument`, `Hidden`,
`FilePath`, `Parsed`, `Default`) live here too, beside the field they describe, where a reader looks for them."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class Range:
    """A number within [low, high] (either end open when None)."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    """The low end is excluded (0 < mfu)."""
    open_high: bool = False

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return self.high is None or (value < self.high if self.open_high else value <= self.high)

    def says(self) -> str:
        """The range in words: "1 or more", "300 to 1,000,000", "above 0 and below 1"."""

        def n(x: float | None) -> str:
            return f"{x:,}" if isinstance(x, int) else f"{x:g}"

        if self.high is None:
            return f"above {n(self.low)}" if self.open_low else f"{n(self.low)} or more"
        if self.low is None:
            return f"below {n(self.high)}" if self.open_high else f"at most {n(self.high)}"
        if not (self.open_low or self.open_high):
            return f"from {n(self.low)} to {n(self.high)}"
        start = f"above {n(self.low)}" if self.open_low else f"at least {n(self.low)}"
        end = f"below {n(self.high)}" if self.open_high else f"at most {n(self.high)}"
        return f"{start} and {end}"


@dataclass(frozen=True, slots=True)
class Size:
    """Bytes, given as 512MB, 2GB or 1.5GiB; `shown` is the default as the user would write it."""

    shown: str


@dataclass(frozen=True, slots=True)
class Tokens(Range):
    """A length in tokens, given as 4096, 32k or 128K."""


@dataclass(frozen=True, slots=True)
class Flag:
    """The option's name where it is not the field's (`--shard-size` for shard_size_bytes)."""

    name: str


@dataclass(frozen=True, slots=True)
class FilePath:
    """A file or folder the user names (a leading ~ is their home)."""


@dataclass(frozen=True, slots=True)
class Argument:
    """A positional argument (several when the field is a tuple), not an option."""


@dataclass(frozen=True, slots=True)
class Hidden:
    """Not on the command line: set by the command from other input, or by code (progress bars, piece sizes)."""


@dataclass(frozen=True, slots=True)
class Parsed:
    """Given as text the command line parses (`name` a parser of pipeline/options.py: ratios, length_mix);
    `shown`: the default as the user would write it."""

    name: str
    shown: str | None = None


@dataclass(frozen=True, slots=True)
class Default:
    """How the help shows a default that is computed (this machine's cores) or left to later (the shards')."""

    shown: str


@dataclass(frozen=True, slots=True)
class FieldInfo:
    """One field of a config dataclass as the command line and the checks read it."""

    name: str
    base: Any
    """The type without its markers (`int`, `str | None`, `Literal['bpe', 'unigram']`, `tuple[str, ...]`)."""
    markers: tuple[Any, ...]
    default: Any
    """dataclasses.MISSING when the field must be given; a factory's field: MISSING too, with `factory` set."""
    factory: bool
    help: str

    def marker(self, kind: type) -> Any:
        return next((m for m in self.markers if isinstance(m, kind)), None)

    @property
    def flag(self) -> str:
        named = self.marker(Flag)
        return f"--{named.name if named else self.name.replace('_', '-')}"

    @property
    def choices(self) -> tuple[str, ...] | None:
        """A Literal's values, also inside `X | None`."""
        for t in (self.base, *typing.get_args(self.base)):
            if typing.get_origin(t) is Literal:
                return tuple(typing.get_args(t))
        return None

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING and not self.factory


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), joined into one line."""
    return _field_docs(cls)


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, after in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


@functools.cache
def fields_of(cls: type) -> tuple[FieldInfo, ...]:
    """The dataclass's fields with their types, markers, defaults and help, in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        markers: tuple[Any, ...] = ()
        if typing.get_origin(hint) is typing.Annotated:
            hint, *rest = typing.get_args(hint)
            markers = tuple(rest)
        factory = f.default_factory is not dataclasses.MISSING
        out.append(FieldInfo(f.name, hint, markers, f.default, factory, docs.get(f.name, "")))
    return tuple(out)


def field_problems(config: Any, prefix: str | None = None) -> list[str]:
    """Every field whose value is outside its `Range` or not one of its `Literal`'s choices, as `--flag value:
    expected ...` (None passes: the field was not given); with `prefix`, named `prefix.field` as a config file
    names it (`optim.lr`)."""
    problems = []
    cls: type = type(config)
    for info in fields_of(cls):
        value = getattr(config, info.name)
        if value is None or isinstance(value, bool):
            continue
        name = f"{prefix}.{info.name}" if prefix else info.flag
        choices = info.choices
        for one in value if isinstance(value, tuple) and choices is not None else (value,):
            if choices is not None and one not in choices:
                names = [str(c) for c in choices]
                problems.append(f"{name} {one}: expected {', '.join(names[:-1])} or {names[-1]}")
        span = info.marker(Range)
        if span is not None and isinstance(value, (int, float)) and not span.holds(value):
            example = "" if info.default in (None, dataclasses.MISSING) else f" (default {info.default})"
            shown = f"{value:g}" if isinstance(value, float) else value
            problems.append(f"{name} {shown}: expected {span.says()}{example}")
    return problems
