"""pipeline.train.setup.schedule: the schedules' table, each entry's rates, what extending a run changes, the
rewarm of continued pretraining, and the refusals of the optim fields that shape them."""

from __future__ import annotations

import math
import typing

import pytest

from pipeline.errors import ConfigError
from pipeline.train.setup.config import OptimSection, from_dict
from pipeline.train.setup.schedule import SCHEDULES, SHAPES, Schedule, first_changed_step, learning_rate, lr_at

BATCH = {"micro_batch_size": 1, "global_batch_size": 2}


def config(**optim: object) -> typing.Any:
    base = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10}
    return from_dict({"optim": base | optim, "train": {"max_steps": 100}, "batch": BATCH})


def test_the_table_is_the_config_s_closed_sets() -> None:
    hints = typing.get_type_hints(OptimSection)
    assert set(typing.get_args(hints["schedule"])) == set(SCHEDULES)
    assert set(typing.get_args(hints["decay_shape"])) == set(SHAPES)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_warms_up_linearly_then_stays_within_min_and_peak(name: str) -> None:
    cfg = config(schedule=name)
    assert [lr_at(s, cfg, 100) for s in (0, 4, 9)] == pytest.approx([1e-4, 5e-4, 1e-3])
    assert all(1e-4 - 1e-15 <= lr_at(s, cfg, 100) <= 1e-3 for s in range(100))
    after = [lr_at(s, cfg, 100) for s in range(10, 100)]
    assert all(b <= a for a, b in zip(after, after[1:], strict=False)), "never rises after warmup"


@pytest.mark.parametrize("shape, at_half", [("linear", 0.5), ("sqrt", 1 - math.sqrt(0.5)), ("cosine", 0.5)])
def test_wsd_is_stable_then_decays_by_its_shape_to_min_lr_at_the_last_update(shape: str, at_half: float) -> None:
    cfg = config(schedule="wsd", decay_steps=20, decay_shape=shape)
    assert {lr_at(s, cfg, 100) for s in range(10, 80)} == {1e-3}, "stable until the decay"
    assert lr_at(89, cfg, 100) == pytest.approx(1e-4 + 9e-4 * at_half)  # 10 of 20 decay updates done
    assert lr_at(99, cfg, 100) == pytest.approx(1e-4)
    ratio = config(schedule="wsd", decay_ratio=0.2, decay_shape=shape)
    assert [lr_at(s, ratio, 100) for s in range(100)] == [lr_at(s, cfg, 100) for s in range(100)]
    default = config(schedule="wsd", decay_shape=shape)  # neither: the last 20%
    assert [lr_at(s, default, 100) for s in range(100)] == [lr_at(s, cfg, 100) for s in range(100)]


def test_a_wsd_run_extended_while_stable_changes_no_trained_rate_and_cosine_changes_them() -> None:
    wsd = Schedule.of(config(schedule="wsd", decay_steps=20))
    assert first_changed_step(wsd, 100, wsd, 200, 79) is None  # extended at step 80: decay not begun
    assert first_changed_step(wsd, 100, wsd, 200, 85) == 80  # extended inside the decay: its rates move
    cosine = Schedule.of(config())
    assert first_changed_step(cosine, 100, cosine, 200, 50) == 11  # every rate after warmup's first
    constant = Schedule.of(config(schedule="constant"))
    assert first_changed_step(constant, 100, constant, 10_000, 99) is None


def test_continued_pretraining_rewarms_from_min_lr() -> None:
    """warmup_from auto: from min_lr when the run starts from a model's weights, from 0 otherwise."""
    fresh = config()
    cont = from_dict(
        {
            "model": {"init_from": "models/x"},
            "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10},
            "train": {"max_steps": 100},
            "batch": BATCH,
        }
    )
    assert Schedule.of(fresh).warmup_start == 0.0 and Schedule.of(cont).warmup_start == 1e-4
    assert lr_at(0, cont, 100) == pytest.approx(1e-4 + 9e-4 / 10)
    zero = from_dict({**cont.to_dict(), "optim": {**cont.to_dict()["optim"], "warmup_from": "zero"}})
    assert Schedule.of(zero).warmup_start == 0.0
    assert learning_rate(9, Schedule.of(cont), 100) == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "optim, says",
    [
        ({"schedule": "cosine", "decay_ratio": 0.2}, "optim.decay_ratio is for optim.schedule wsd"),
        ({"schedule": "cosine", "decay_shape": "sqrt"}, "optim.decay_shape is for optim.schedule wsd"),
        ({"schedule": "wsd", "decay_ratio": 1.5}, r"optim.decay_ratio 1.5: expected above 0 and at most 1"),
        ({"schedule": "wsd", "decay_ratio": 0.2, "decay_steps": 10}, "one of decay_steps or decay_ratio"),
        ({"schedule": "constant", "decay_steps": 10}, "a constant schedule has no decay"),
        ({"schedule": "linear"}, r"optim.schedule linear: expected cosine, wsd or constant"),
        ({"warmup_from": "max"}, r"optim.warmup_from max: expected auto, zero or min_lr"),
    ],
)
def test_schedule_fields_that_do_not_fit_together_are_refused_naming_them(optim: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        config(**optim)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_each_schedule_describes_itself_with_its_numbers(name: str) -> None:
    line = Schedule.of(config(schedule=name)).describe(100)
    assert line.startswith(f"schedule {name}: warmup 10 steps from 0 to 0.001")
    if name == "wsd":
        assert "stable to step 80, linear decay to 0.0001 over steps 81-100" in line
