"""pipeline.train.setup.ds_config: the batch arithmetic against the world size."""

from __future__ import annotations

import pytest


def test_976_sequences_on_7_nodes_are_refused_with_the_choices() -> None:
    from pipeline.errors import ConfigError
    from pipeline.train.setup.config import from_dict
    from pipeline.train.setup.ds_config import batch_plan

    cfg = from_dict({"batch": {"micro_batch_size": 2, "global_batch_size": 976}, "train": {"max_steps": 1}})
    with pytest.raises(
        ConfigError,
        match=r"no micro_batch_size divides it on 7 ranks; or --set "
        r"batch.global_batch_size=966 or 980",
    ):
        batch_plan(cfg, 7, 4096)
    assert batch_plan(cfg, 8, 4096).grad_accum == 61


def _resolve(ds: dict, *, precision: str = "bf16", global_batch: int = 8, checkpointing: bool = False) -> dict:
    from pipeline.train.setup.config import from_dict
    from pipeline.train.setup.ds_config import batch_plan, resolve

    cfg = from_dict(
        {
            "batch": {"micro_batch_size": 2, "global_batch_size": global_batch},
            "train": {"max_steps": 1, "precision": precision, "activation_checkpointing": checkpointing},
            "checkpoint": {"interval": 4},
        }
    )
    return resolve(cfg, ds, batch_plan(cfg, 2, 64), accelerator="cuda")


OFFLOAD = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
ZENFLOW = {"topk_ratio": 0.1, "select_strategy": "step", "select_interval": 2, "update_interval": 2}

FEATURE_REFUSALS = [
    ({"bf16": {"bf16_optimizer_states": True}, "zero_optimization": OFFLOAD}, {}, "needs bf16.bf16_master_weights"),
    (
        {"bf16": {"bf16_master_weights_and_grads": True}, "zero_optimization": OFFLOAD},
        {"precision": "fp32"},
        "need train.precision bf16, not fp32",
    ),
    (
        {"zero_optimization": {"stage": 2, "zenflow": ZENFLOW}},
        {"global_batch": 4},
        "needs offload_optimizer.device cpu",
    ),
    (
        {"zero_optimization": {**OFFLOAD, "stage": 3, "zenflow": ZENFLOW}},
        {"global_batch": 4},
        "with ZeRO-3 does not run in DeepSpeed 0.19.8",
    ),
    (
        {"zero_optimization": {**OFFLOAD, "zenflow": ZENFLOW}},
        {"global_batch": 8},
        "Set batch.global_batch_size 4 (micro_batch_size x ranks) and zenflow.update_interval 2 to keep 8",
    ),
    (
        {"zero_optimization": {**OFFLOAD, "zenflow": {**ZENFLOW, "update_interval": "auto"}}},
        {"global_batch": 4},
        "update_interval 'auto': give a whole number of steps",
    ),
    (
        {"zero_optimization": {**OFFLOAD, "zenflow": {**ZENFLOW, "select_strategy": "epoch"}}},
        {"global_batch": 4},
        "its epoch-based choices never reselect",
    ),
    (
        {"zero_optimization": {**OFFLOAD, "zenflow": {**ZENFLOW, "update_interval": 3, "select_interval": 3}}},
        {"global_batch": 4},
        "checkpoint.interval 4 is not a multiple of zenflow.update_interval 3",
    ),
    (
        {"zero_optimization": OFFLOAD, "activation_checkpointing": {"cpu_checkpointing": True}},
        {},
        "needs train.activation_checkpointing: true",
    ),
]


@pytest.mark.parametrize("ds, kw, expected", FEATURE_REFUSALS, ids=[str(i) for i in range(len(FEATURE_REFUSALS))])
def test_offload_features_that_cannot_run_are_refused_before_launch(ds: dict, kw: dict, expected: str) -> None:
    """DeepSpeed 0.19's offload features in combinations that fail inside DeepSpeed, or would quietly do something
    else than the config says (ZenFlow's accumulation), are refused in one line each, before any rank starts."""
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="problem") as e:
        _resolve(ds, **kw)
    assert expected in str(e.value)


def test_offload_features_in_working_combinations_pass() -> None:
    states = {"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    assert _resolve({**states, "zero_optimization": OFFLOAD})["bf16"]["bf16_optimizer_states"] is True
    zen = _resolve({"zero_optimization": {**OFFLOAD, "zenflow": ZENFLOW}}, global_batch=4)
    assert zen["gradient_accumulation_steps"] == 1 and zen["zero_optimization"]["zenflow"]["update_interval"] == 2
    act = {"zero_optimization": OFFLOAD, "activation_checkpointing": {"cpu_checkpointing": True}}
    assert _resolve(act, checkpointing=True)["activation_checkpointing"]["cpu_checkpointing"] is True


def test_the_optimizer_table_is_what_the_config_offers_and_what_the_planner_prices() -> None:
    """optim.name's choices are the table's keys; an optimizer's stages, offload and state bytes reach the DeepSpeed
    checks and the planner's memory (8-bit AdamW's states are a quarter of Adam's moments)."""
    import typing

    from pipeline.model import PRESETS
    from pipeline.plan.memory import checkpoint_bytes, state_split
    from pipeline.train.setup.config import OptimSection
    from pipeline.train.setup.optimizers import OPTIMIZERS

    assert set(typing.get_args(typing.get_type_hints(OptimSection)["name"])) == set(OPTIMIZERS)
    adam, bnb = OPTIMIZERS["adamw"], OPTIMIZERS["adamw8bit"]
    assert adam.problems("adamw", 3, True) == [] and bnb.problems("adamw8bit", 2, False) == []
    assert "ZeRO-3" in bnb.problems("adamw8bit", 3, False)[0] and "offload" in bnb.problems("adamw8bit", 2, True)[0]
    psi = PRESETS["1b"].num_params()
    full = state_split(2, psi, 1, False, False, moment_bytes=adam.moment_bytes)["optimizer"]
    eight = state_split(2, psi, 1, False, False, moment_bytes=bnb.moment_bytes)["optimizer"]
    assert full == 12 * psi and 6 * psi < eight < 6.01 * psi
    assert checkpoint_bytes(PRESETS["1b"], 2, 1, 1, state_bytes=4 + bnb.moment_bytes)["total"] < 8.1 * psi
