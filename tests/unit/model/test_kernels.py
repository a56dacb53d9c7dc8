"""pipeline.model.kernels: the speed switches' tables, how each resolves where it runs (a GPU-only choice on the
CPU says what it used instead), and the model's fused-loss hook against the chunked loss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipeline.model import build_model, kernels, resolve_shape
from pipeline.train.setup.config import TrainSection, _choices
from pipeline.train.step import lm_loss, reduce_token_losses

TINY = resolve_shape("tiny", {}, 300)


def test_the_configs_choices_are_the_tables_keys() -> None:
    fields = TrainSection.__dataclass_fields__
    assert _choices(str(fields["attention"].type)) == list(kernels.ATTENTION)
    assert _choices(str(fields["kernels"].type)) == list(kernels.KERNEL_SETTINGS)


def test_on_the_cpu_gpu_attention_kernels_fall_back_and_say_so() -> None:
    cpu = torch.device("cpu")
    auto = kernels.choose_attention("auto", TINY, 2, 64, cpu)
    assert auto.backend == "torch" and "only on a CUDA GPU" in auto.note and auto.timings_ms is None
    cudnn = kernels.choose_attention("cudnn", TINY, 2, 64, cpu)
    assert cudnn.backend == "torch" and "cudnn is a CUDA kernel" in cudnn.note and "instead" in cudnn.note
    assert kernels.choose_attention("math", TINY, 2, 64, cpu).backend == "math"
    kernels.apply_attention(kernels.AttentionChoice("torch", ""))  # torch's own order: nothing to set


def test_liger_on_the_cpu_keeps_transformers_modules_and_says_why() -> None:
    choice = kernels.choose_kernels("liger", TINY, "cpu", zero3=False)
    assert (choice.kernels, choice.fused_loss) == ("torch", False)
    assert "runs on cpu" in choice.note and "using transformers' modules" in choice.note
    assert kernels.choose_kernels("auto", TINY, "cpu", zero3=False).kernels == "torch"


def test_liger_names_a_family_it_has_no_kernels_for() -> None:
    phi = replace(TINY, hf_config={"model_type": "phi3"})
    choice = kernels.choose_kernels("liger", phi, "cuda", zero3=False)
    assert choice.kernels == "torch" and "no kernels for the phi3 family" in choice.note


def test_auto_on_a_gpu_follows_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled layers keep transformers' modules; eager ones take Liger's; without the package auto says how to
    get it; under ZeRO-3 the fused loss gives way to the chunked one (lm_head's weight is partitioned)."""
    monkeypatch.setattr(kernels, "_installed", lambda package: False)
    missing = kernels.choose_kernels("auto", TINY, "cuda", zero3=False, compiled=False)
    assert missing.kernels == "torch" and "pip install liger-kernel" in missing.note
    monkeypatch.setattr(kernels, "_installed", lambda package: True)
    assert kernels.choose_kernels("auto", TINY, "cuda", zero3=False, compiled=True).kernels == "torch"
    eager = kernels.choose_kernels("auto", TINY, "cuda", zero3=False, compiled=False)
    assert (eager.kernels, eager.fused_loss) == ("liger", True)
    zero3 = kernels.choose_kernels("liger", TINY, "cuda", zero3=True)
    assert (zero3.kernels, zero3.fused_loss) == ("liger", False) and "ZeRO-3 the chunked loss stays" in zero3.note


@pytest.mark.parametrize(
    "setting, device, stage, on",
    [
        (None, "cpu", 2, False),
        (None, "cuda", 2, True),
        (None, "cuda", 0, True),
        (None, "cuda", 3, False),
        (True, "cpu", 2, True),
        (False, "cuda", 2, False),
    ],
)
def test_compile_auto_compiles_on_a_gpu_below_zero3(setting: bool | None, device: str, stage: int, on: bool) -> None:
    got, note = kernels.choose_compile(setting, device, stage)
    assert got is on and note.startswith(f"compile: {'on' if on else 'off'}")
    if device == "cuda" and stage < 3:  # sequence parallelism or the tiled MLP: auto stays eager, asked for compiles
        assert kernels.choose_compile(setting, device, stage, long_context=True)[0] is bool(setting)


@pytest.mark.parametrize("switch", ["TORCHDYNAMO_DISABLE", "TORCH_COMPILE_DISABLE"])
def test_an_environment_that_turns_torch_compile_off_is_said_not_hidden(
    switch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With either switch torch.compile hands back the layer unchanged: the run reports compile off and why, asked
    for or auto, instead of "compile: on" over eager layers; "0" or unset leaves the choice as it was."""
    for setting in (True, None):
        got, note = kernels.choose_compile(setting, "cuda", 2, environ={switch: "1"})
        assert got is False and f"{switch}=1 in the environment" in note
    assert kernels.choose_compile(False, "cuda", 2, environ={switch: "1"}) == (False, "compile: off (asked for)")
    assert kernels.choose_compile(True, "cpu", 2, environ={switch: "0"}) == (True, "compile: on (asked for)")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # what the first switch does to torch.compile itself

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert torch.compile(double) is double


def test_a_fused_loss_returns_the_sum_and_trains_as_the_chunked_loss() -> None:
    """The model's fused-loss hook (Liger's kernel on a GPU; here the same sum computed by torch) gives the chunked
    loss's mean, total and gradients; without gradients (evaluation) the per-token chunked loss stays."""

    def summed(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(hidden @ weight.T, labels, ignore_index=-100, reduction="sum")

    torch.manual_seed(0)
    model = build_model(TINY)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 300, (3, 33), generator=g), torch.randint(0, 300, (3, 33), generator=g)
    labels[2, 20:] = -100
    plain, plain_total, n = lm_loss(model(input_ids=ids).logits, labels)
    plain.backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.fused_loss = summed
    out = model(input_ids=ids, loss_labels=labels)
    assert out.dim() == 0
    fused, fused_total, m = reduce_token_losses(out, labels)
    fused.backward()
    assert n == m == 86 and torch.allclose(fused, plain, rtol=1e-6)
    assert fused_total.dtype == torch.float64 and abs(float(fused_total) - float(plain_total)) < 1e-4
    for p, ref in zip(model.parameters(), reference, strict=True):
        assert torch.allclose(p.grad, ref, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        assert model(input_ids=ids, loss_labels=labels).shape == (3 * 33,)


def test_a_tiled_mlp_gives_the_untiled_outputs_and_gradients() -> None:
    """train.tiled_mlp: each layer's MLP in 4 tiles along the sequence, recomputed in the backward: the same
    logits, input gradients and weight gradients as the whole sequence at once (fp32, up to rounding)."""
    import copy

    import torch

    from pipeline.model import build_model, kernels, resolve_shape

    torch.manual_seed(0)
    whole = build_model(resolve_shape("tiny", {}, 500))
    tiled = copy.deepcopy(whole)
    assert kernels.tile_mlp(tiled, 4) == 2 and kernels.tile_mlp(copy.deepcopy(whole), 1) == 0
    ids = torch.randint(0, 500, (2, 64))
    outs = []
    for model in (whole, tiled):
        hidden = model.model.embed_tokens(ids).detach().requires_grad_(True)
        logits = model(inputs_embeds=hidden).logits
        logits.square().mean().backward()
        outs.append((logits.detach(), hidden.grad, {n: p.grad for n, p in model.named_parameters()}))
    (a, ga, wa), (b, gb, wb) = outs
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-6) and torch.allclose(ga, gb, rtol=1e-5, atol=1e-7)
    assert wa.keys() == wb.keys() and [n for n, g in wa.items() if g is None] == ["model.embed_tokens.weight"]
    for name in (n for n, g in wa.items() if g is not None):
        assert wb[name] is not None and torch.allclose(wa[name], wb[name], rtol=1e-5, atol=1e-7), name


def test_the_planner_resolves_the_switches_as_the_trainer_does_on_a_gpu() -> None:
    """gpu_switches: compile on where auto compiles (ZeRO 0-2, no long-context parts), Liger where the layers run
    eager, its fused loss but under ZeRO-3; each with the measured effect of its table entry, combined as measured
    (compile and Liger together fuse what either does alone; for memory, Liger's layout, which keeps more); the
    packages as the cluster's nodes have them."""
    liger = frozenset({"liger-kernel"})
    sw = kernels.gpu_switches(None, "auto", TINY, 2, False, liger)
    assert (sw.compiled, sw.kernels, sw.effect) == (True, "torch", kernels.COMPILE_EFFECT)
    sw = kernels.gpu_switches(None, "auto", TINY, 3, False, liger)
    assert (sw.compiled, sw.kernels, sw.fused_loss) == (False, "liger", False)
    assert sw.effect == kernels.KERNELS["liger"].effect and sw.effect.activations == "liger"
    sw = kernels.gpu_switches(None, "auto", TINY, 2, True, liger)  # sequence parallelism or the tiled MLP: eager
    assert (sw.compiled, sw.kernels, sw.fused_loss) == (False, "liger", True)
    assert kernels.gpu_switches(None, "auto", TINY, 3, False, frozenset()).kernels == "torch"
    both = kernels.gpu_switches(True, "liger", TINY, 1, False, liger)
    assert both.effect.activations == "liger"
    knees = (kernels.COMPILE_EFFECT.knee_factor, kernels.KERNELS["liger"].effect.knee_factor)
    assert both.compiled and both.kernels == "liger" and both.effect.knee_factor == min(knees)
    assert kernels.gpu_switches(False, "torch", TINY, 2, False).effect is kernels.NO_EFFECT
    phi3 = replace(TINY, hf_config={"model_type": "phi3"})  # no Liger kernels for it: transformers modules
    assert kernels.gpu_switches(False, "liger", phi3, 2, False).effect is kernels.NO_EFFECT
    for entry in kernels.KERNELS.values():  # every entry names where its effect was measured
        assert entry.effect is kernels.NO_EFFECT or "H200" in entry.effect.measured


def test_fp8_takes_the_decoder_projections_whose_dimensions_allow_it_and_keeps_the_model_the_same() -> None:
    """train.fp8's rule (pipeline.model.kernels.fp8_keeps): each decoder projection with both dimensions multiples
    of 16 becomes torchao's Float8Linear, emulated here; lm_head, embeddings and norms do not. The parameters and
    their names stay the bf16 model's (checkpoints and exports unchanged), and the loss moves by float8's
    rounding only."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    shape = resolve_shape("tiny", {"hidden_size": 64, "ffn_hidden_size": 172}, 300)  # 172: MLP stays bf16
    plain = build_model(shape)
    model = build_model(shape)
    model.load_state_dict(plain.state_dict())
    choice = kernels.choose_fp8(True, torch.device("cpu"), shape)
    assert choice.on and choice.emulate and "8 of the decoder's linear layers" in choice.note
    assert kernels.apply_fp8(model, choice) == kernels.fp8_layers(shape) == 8  # q, k, v, o of 2 layers
    swapped = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert swapped == {f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"}
    assert list(model.state_dict()) == list(plain.state_dict())
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    a, b = plain(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss
    b.backward()
    assert b.item() == pytest.approx(a.item(), rel=0.02) and b.item() != a.item()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert kernels.choose_fp8(False, torch.device("cpu"), shape).on is False


def test_fp8_is_refused_where_it_cannot_run_naming_the_fix() -> None:
    from pipeline.errors import ConfigError
    from pipeline.train.setup.config import from_dict
    from pipeline.train.setup.ds_config import batch_plan, load_ds_config, resolve

    base = {"batch": {"micro_batch_size": 1, "global_batch_size": 2}, "train": {"max_steps": 1, "fp8": True}}
    with pytest.raises(ConfigError, match="train.fp8 needs train.precision bf16"):
        from_dict(base | {"train": base["train"] | {"precision": "fp32"}})
    cfg = from_dict(base | {"train": base["train"] | {"precision": "bf16"}})
    with pytest.raises(ConfigError, match="train.fp8 with ZeRO-3: not supported"):
        resolve(cfg, load_ds_config("ds_configs/zero3.json"), batch_plan(cfg, 2, 64), accelerator="cuda")
    resolve(cfg, load_ds_config("ds_configs/zero2.json"), batch_plan(cfg, 2, 64), accelerator="cuda")


def test_auto_times_the_backends_at_one_ranks_shape_compares_the_backward_and_stops_at_its_budget(monkeypatch) -> None:
    """The timing `auto` runs on a GPU, run here on the CPU's SDPA kernels (flash and math): under sequence parallel 2
    each call is seq x heads / 2 (tiny: 4 heads, 2 kv -> 2 and 1); a backend whose gradients differ is named as
    disagreeing even where its output agrees; the repeats stop when the budget is spent."""
    import torch.nn.functional as F

    shapes: list[tuple[int, ...]] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):  # noqa: ANN001, ANN003, ANN202
        shapes.append((*q.shape, k.shape[1]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    cpu = torch.device("cpu")
    timings = kernels.time_backends(TINY, 1, 64, cpu, repeats=2, sequence_parallel=2, backends=("flash", "math"))
    assert set(timings) == {"flash", "math"} and all(isinstance(t, float) for t in timings.values()), timings
    assert set(shapes) == {(1, 2, 64, TINY.head_dim, 1)}
    assert kernels.attention_heads(TINY, 4) == (1, 1) and kernels.attention_heads(TINY, 1) == (4, 2)

    class WrongBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):  # noqa: ANN001, ANN205
            return y.clone()

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            return -g

    def wrong_when_math(q, k, v, **kw):  # noqa: ANN001, ANN003, ANN202
        y = real(q, k, v, **kw)
        return WrongBackward.apply(y) if torch.backends.cuda.math_sdp_enabled() and not flash() else y

    def flash() -> bool:
        return torch.backends.cuda.flash_sdp_enabled()

    monkeypatch.setattr(F, "scaled_dot_product_attention", wrong_when_math)
    timings = kernels.time_backends(TINY, 1, 64, cpu, repeats=1, backends=("flash", "math"))
    said = str(timings["math"])  # its output is flash's; its gradients are not
    assert isinstance(timings["flash"], float) and said.startswith("disagrees with flash by"), timings
    assert said.endswith(("(dq)", "(dk)", "(dv)")), said

    calls = []
    assert kernels.timed(lambda: calls.append(1), 1000, 0.0, lambda: None)[1] == 1  # a spent budget: one call
    assert kernels.timed(lambda: calls.append(1), 3, 1e9, lambda: None)[1] == 3  # else the repeats asked for


def test_kernels_are_priced_as_the_nodes_have_them(monkeypatch) -> None:
    """A plan for a cluster prices train.kernels against the packages its nodes are known to have (none unless the
    facts or a probe say); `deepspeed_config: auto`, on the node that runs, against what that node has. Without
    liger-kernel: transformers' modules, which keep more activations (the plan then fits what will run)."""
    from pipeline.model import PRESETS
    from pipeline.plan.cluster import _SWITCHES, Cluster, Layout, Stack
    from pipeline.plan.gpus import GPUS
    from pipeline.plan.memory import gpu_memory

    shape, cand = PRESETS["7b"], Layout(3, "cpu", "cpu", True, 1, 1)
    c = Cluster(1, 1, GPUS["4090d"], 120e9)
    for installed in (False, True):
        monkeypatch.setattr(kernels, "_installed", lambda package, ok=installed: ok)
        _SWITCHES.clear()  # resolved per process; this test changes what is installed
        here = Stack(compile=False, kernel_set="auto").resolved(shape, cand)
        with_liger = Stack(compile=False, kernel_set="auto", packages=frozenset({"liger-kernel"})).resolved(shape, cand)
        unknown = Stack(compile=False, kernel_set="auto", packages=frozenset()).resolved(shape, cand)
        assert with_liger.switches is not None and with_liger.switches.kernels == "liger"
        assert unknown.switches is not None and unknown.switches.kernels == "torch"
        assert here.switches is not None and here.switches.kernels == ("liger" if installed else "torch")
        act = [gpu_memory(shape, 32768, c, cand, 2048, s)["activations"] for s in (unknown, with_liger)]
        assert act[0] > act[1]  # transformers' modules keep more than Liger's
    _SWITCHES.clear()
