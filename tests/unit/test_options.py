"""Each command-line option backed by a config field is generated from that field (pipeline/options.py
`config_options`, pipeline/fields.py): its name, type, choices, default and help are the field's, so nothing is
written twice, and a new field is a new option without an edit of pipeline/cli.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import click
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.data.config import CurateOptions, ShardConfig, TokenizeConfig, VocabConfig
from pipeline.errors import ConfigError
from pipeline.evaluate.config import EvalConfig, ExportConfig, HarnessConfig
from pipeline.fields import Argument, FilePath, Hidden, Range, Size, field_problems, fields_of
from pipeline.options import config_from, config_options
from pipeline.plan.request import PlanRequest, ProbeRequest

CONFIGS: dict[str, type] = {
    "curate": CurateOptions,
    "tokenize": TokenizeConfig,
    "extend-vocab": VocabConfig,
    "shard": ShardConfig,
    "evaluate": EvalConfig,
    "export": ExportConfig,
    "harness": HarnessConfig,
    "plan": PlanRequest,
    "probe": ProbeRequest,
}
"""Each command whose options are a config's fields, and that config."""


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_field_is_its_commands_option_as_declared(name: str) -> None:
    command = main.commands[name]
    params = {p.name: p for p in command.params}
    for info in fields_of(CONFIGS[name]):
        if info.marker(Hidden):  # set by the command from other input (shard's parsed sources, plan's --opt-in)
            continue
        p = params.get(info.name)
        assert p is not None, f"{name}: field {info.name} has no option"
        if info.marker(Argument):
            assert isinstance(p, click.Argument)
            continue
        assert (p.help or "").startswith(info.help), f"{name} {info.flag}: help is not the field's docstring"
        assert info.flag in p.opts, (name, info.flag, p.opts)
        if info.choices is not None:
            assert isinstance(p.type, click.Choice) and tuple(p.type.choices) == info.choices
        if info.required or info.factory:
            assert p.default is None
        elif info.marker(Size) is not None:
            from pipeline.units import parse_size

            assert int(parse_size(p.default)) == info.default, f"{name} {info.flag}: {p.default} != {info.default}"
        elif info.base is bool or not isinstance(info.default, tuple):
            assert p.default == info.default, f"{name} {info.flag}: default {p.default!r} != {info.default!r}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parsing_no_options_gives_the_fields_defaults(name: str) -> None:
    """What the command builds when an option is left out is the field's default, whatever click passed."""
    cls = CONFIGS[name]
    required = {i.name: _sample(i) for i in fields_of(cls) if i.required}
    given = required | ({"tokenizer": "t.model"} if cls is TokenizeConfig else {})
    cfg = config_from(cls, {i.name: None for i in fields_of(cls)} | given)
    for info in fields_of(cls):
        if info.name not in given and not info.factory:
            assert getattr(cfg, info.name) == info.default, info.name


def _sample(info: Any) -> Any:
    if info.name == "sources":
        return (("corpus", 1.0),)
    if info.name == "seq_len":
        return 64
    return ("x",) if getattr(info.base, "__origin__", None) is tuple else "x"


def test_a_new_field_is_a_new_option_with_no_cli_edit(tmp_path: Path) -> None:
    """The pattern every command follows, on a config the CLI has never seen: its fields become options with
    their types, ranges, choices and defaults, and what was typed arrives in the config."""

    @dataclass(frozen=True, kw_only=True)
    class Stage:
        inputs: Annotated[tuple[str, ...], Argument(), FilePath()]
        """What the stage reads."""
        depth: Annotated[int, Range(1, 8)] = 2
        """How deep."""
        mode: Literal["fast", "exact"] = "exact"
        """How it goes."""
        budget: Annotated[int, Size("1MB")] = 10**6
        """Bytes at most."""
        verbose: bool = False
        """Say more."""
        tags: tuple[str, ...] = ()
        """Repeatable."""
        internal: Annotated[int, Hidden()] = 7
        """Not an option."""

        def __post_init__(self) -> None:
            if problems := field_problems(self):
                raise ConfigError(problems, "stage options")

    seen: list[Stage] = []

    @click.command()
    @config_options(Stage)
    def stage(**options: Any) -> None:
        seen.append(config_from(Stage, options))

    r = CliRunner().invoke(stage, ["a", "b", "--depth", "3", "--mode", "fast", "--budget", "2MB", "--verbose"])
    assert r.exit_code == 0, r.output
    assert seen[-1] == Stage(inputs=("a", "b"), depth=3, mode="fast", budget=2 * 10**6, verbose=True)
    r = CliRunner().invoke(stage, ["a", "--tags", "x", "--tags", "y"])
    assert r.exit_code == 0 and seen[-1] == Stage(inputs=("a",), tags=("x", "y")), r.output
    help_text = CliRunner().invoke(stage, ["--help"]).output
    assert "How deep. [from 1 to 8]" in help_text and "[default: 2]" in help_text and "--internal" not in help_text
    assert CliRunner().invoke(stage, ["a", "--mode", "slow"]).exit_code == 2
    with pytest.raises(ConfigError) as e:
        config_from(Stage, {"inputs": ("a",), "depth": 9, "budget": 0})
    assert "--depth 9: expected from 1 to 8 (default 2)" in str(e.value)


def test_every_problem_of_a_config_is_named_at_once() -> None:
    with pytest.raises(ConfigError) as e:
        TokenizeConfig(inputs=("c.jsonl",), output_prefix="o", train_tokenizer=True, vocab_size=10, workers=0)
    said = str(e.value)
    assert "--vocab-size 10: expected from 300 to 1,000,000" in said and "--workers 0: expected from 1 to 512" in said
    assert CurateOptions(near_threshold=1.0).problems() == [
        "--near-threshold 1: expected above 0 and below 1 (default 0.3)"
    ]


def test_each_config_field_says_what_it_is() -> None:
    """Every field of every command's config has its docstring (the option's help); the markers' defaults parse."""
    for cls in CONFIGS.values():
        for info in fields_of(cls):
            assert info.help, f"{cls.__name__}.{info.name} has no docstring"
            assert (
                info.default is dataclasses.MISSING
                or info.factory
                or info.name in {f.name for f in dataclasses.fields(cls)}
            )


def test_a_signal_a_library_turned_into_its_own_error_still_ends_the_command_as_the_signal() -> None:
    """SIGTERM landing inside sentencepiece's import came out as `ImportError: initialization failed`, which the
    tokenizer's loader reported as a tokenizer it cannot load (exit 2): found by tests/unit/test_writers.py. Any
    error after a signal is its consequence; the command ends as the signal asks."""
    from pipeline.atomic import interrupt
    from pipeline.errors import PipelineError
    from pipeline.options import Terminated, user_errors

    @click.command()
    @user_errors
    def stage() -> None:
        try:
            try:
                interrupt(Terminated())
            except Terminated:
                raise ImportError("initialization failed") from None
        except ImportError as e:
            raise PipelineError(f"corpus.tokenizer.model: cannot load tokenizer ({e})") from None

    r = CliRunner().invoke(stage, [])
    assert r.exit_code == 143 and "terminated (SIGTERM)" in r.output and "cannot load" not in r.output, r.output

    @click.command()
    @user_errors
    def plain() -> None:  # the next command in the same process: its own errors are its own
        raise PipelineError("a mistake")

    r = CliRunner().invoke(plain, [])
    assert r.exit_code == 2 and "error: a mistake" in r.output
