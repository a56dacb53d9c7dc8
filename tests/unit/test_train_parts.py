"""The parts of the training loop that need no process group: the resume decision, device selection, the loss."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.train.checkpoint import Marker
from pipeline.train.dist import device_for, local_rank_from_env
from pipeline.train.resume import choose_resume, resume_problems
from pipeline.train.step import lm_loss

TAGS = ["step00000005", "step00000010"]
SHAPE = {"hidden_size": 64, "num_layers": 2}


def marker(**kw: object) -> Marker:
    m: Marker = {
        "step": 10,
        "consumed_samples": 80,
        "data_fingerprint": "abc",
        "seq_len": 64,
        "tokenizer_sha256": "t",
        "model_shape": SHAPE,
        "world_size": 2,
    }
    m.update(kw)  # type: ignore[typeddict-item]
    return m


def test_resume_policy_auto_never_and_tag() -> None:
    assert choose_resume("auto", TAGS, "runs/x") == "step00000010"
    assert choose_resume("auto", [], "runs/x") is None
    assert choose_resume("never", [], "runs/x") is None
    with pytest.raises(PipelineError, match="holds checkpoints but checkpoint.resume is never"):
        choose_resume("never", TAGS, "runs/x")
    assert choose_resume("step00000005", TAGS, "runs/x") == "step00000005"
    with pytest.raises(PipelineError, match="checkpoint.resume step00000007: no complete checkpoint"):
        choose_resume("step00000007", TAGS, "runs/x")


def test_resume_refuses_other_data_shape_or_zero_world() -> None:
    same = dict(data_fingerprint="abc", model_shape=SHAPE, world_size=2, zero_stage=1)
    assert resume_problems(marker(), **same) == []  # type: ignore[arg-type]
    assert "data fingerprint xyz differs" in resume_problems(marker(), **{**same, "data_fingerprint": "xyz"})[0]  # type: ignore[arg-type]
    assert "model shape" in resume_problems(marker(), **{**same, "model_shape": {"hidden_size": 32}})[0]  # type: ignore[arg-type]
    # Another world size resumes (through a universal checkpoint; tests/multiproc/test_resume_world_size.py), except
    # with the optimizer on NVMe, whose swap files the universal checkpoint does not cover.
    assert resume_problems(marker(), **{**same, "world_size": 4}) == []  # type: ignore[arg-type]
    assert "optimizer is on NVMe" in resume_problems(marker(), **{**same, "world_size": 4, "nvme_optimizer": True})[-1]  # type: ignore[arg-type]


def test_976_sequences_on_7_nodes_are_refused_with_the_choices() -> None:
    from pipeline.errors import ConfigError
    from pipeline.train.config import from_dict
    from pipeline.train.ds_config import batch_plan

    cfg = from_dict({"batch": {"micro_batch_size": 2, "global_batch_size": 976}, "train": {"max_steps": 1}})
    with pytest.raises(
        ConfigError,
        match=r"no micro_batch_size divides it on 7 ranks; or --set "
        r"batch.global_batch_size=966 or 980",
    ):
        batch_plan(cfg, 7, 4096)
    assert batch_plan(cfg, 8, 4096).grad_accum == 61


def test_each_rank_gets_the_gpu_of_its_local_rank() -> None:
    # Ranks 1..3 of a 4-GPU node must not land on cuda:0 (DeepSpeed selects no device at init_distributed).
    assert [device_for("cuda", local_rank_from_env({"LOCAL_RANK": str(r)})) for r in range(4)] == [
        torch.device("cuda", r) for r in range(4)
    ]
    assert device_for("cpu", 3) == torch.device("cpu")
    assert local_rank_from_env({}) == 0


def test_loss_counts_real_tokens_only_and_sums_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[1, 3:] = -100
    loss, total, count = lm_loss(logits, labels)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)
    assert count == 8
    assert torch.allclose(loss, ref, rtol=1e-6)
    assert total.dtype == torch.float64 and abs(float(total) / count - float(ref)) < 1e-6


@pytest.mark.parametrize("chunk", [7, 48, None])
def test_chunked_loss_equals_the_plain_loss_and_its_gradients(chunk: int | None) -> None:
    from pipeline.model import build_model, resolve_shape
    from pipeline.train.step import reduce_token_losses

    torch.manual_seed(0)
    model = build_model(resolve_shape("tiny", {}, 300))
    model.loss_chunk_tokens = chunk
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (3, 33), generator=g)
    labels = torch.randint(0, 300, (3, 33), generator=g)
    labels[2, 20:] = -100

    plain, plain_total, n = lm_loss(model(input_ids=ids).logits, labels)
    plain.backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    chunked, chunked_total, m = reduce_token_losses(model(input_ids=ids, loss_labels=labels), labels)
    chunked.backward()
    assert n == m == 86
    assert torch.allclose(chunked, plain, rtol=1e-6, atol=0)
    assert abs(float(chunked_total) - float(plain_total)) <= 1e-6 * abs(float(plain_total))
    for p, ref in zip(model.parameters(), plain_grads, strict=True):
        assert torch.allclose(p.grad, ref, rtol=1e-5, atol=1e-7)


def test_resume_of_nvme_optimizer_checkpoints_is_refused_with_the_reason() -> None:
    problems = resume_problems(
        marker(), data_fingerprint="abc", model_shape=SHAPE, world_size=2, zero_stage=3, nvme_optimizer=True
    )
    assert len(problems) == 1 and "freshly initialised weights" in problems[0] and "zero3_offload.json" in problems[0]


def test_auto_plan_uses_the_memory_cap() -> None:
    from pipeline.train.prepare import planning_card

    h200 = 143 * 10**9
    assert planning_card("NVIDIA H200", h200, None).memory_gib == pytest.approx(h200 / 2**30)
    capped = planning_card("NVIDIA H200", h200, 24.0)
    assert capped.memory_gib == 24.0 and capped.bf16_tflops == 989.0
    with pytest.raises(PipelineError, match="no planner data for GPU 'NVIDIA Voodoo2'"):
        planning_card("NVIDIA Voodoo2", h200, None)


def test_missing_transformers_helpers_name_the_version_needed() -> None:
    from pipeline.errors import ConfigError
    from pipeline.model import transformers_helper

    assert callable(transformers_helper("transformers.initialization", "no_init_weights"))
    with pytest.raises(
        ConfigError, match=r"lacks transformers.integrations.deepspeed.gone.*install transformers>=5,<6"
    ):
        transformers_helper("transformers.integrations.deepspeed", "gone")
