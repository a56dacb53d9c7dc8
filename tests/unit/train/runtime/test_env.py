"""pipeline.train.runtime.env: the env files every rank applies, and P2P off for several GeForce cards on a node."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.train.runtime.env import apply_env_files, p2p_default, read_env_files


def test_env_files_apply_unless_the_environment_says_otherwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, here = tmp_path / "home", tmp_path / "here"
    home.mkdir(), here.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=eth0\nNCCL_IB_DISABLE=1\n")
    (here / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=enp65s0f0\nnot a setting\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    assert read_env_files() == {"NCCL_SOCKET_IFNAME": "enp65s0f0", "NCCL_IB_DISABLE": "1"}  # this folder wins
    environ = {"NCCL_IB_DISABLE": "0"}
    assert apply_env_files(environ) == {"NCCL_SOCKET_IFNAME": "enp65s0f0"}
    assert environ == {"NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": "enp65s0f0"}  # the user's own value kept


def test_p2p_is_disabled_for_several_geforce_cards_unless_the_user_chose() -> None:
    four = ["NVIDIA GeForce RTX 4090 D"] * 4
    environ: dict[str, str] = {}
    assert "NCCL_P2P_DISABLE=1" in (p2p_default(four, 4, environ) or "") and environ == {"NCCL_P2P_DISABLE": "1"}
    assert p2p_default(four, 1, {}) is None  # one rank per node: no P2P to hang
    assert p2p_default(["NVIDIA H100 80GB HBM3"] * 8, 8, {}) is None  # NVLink: P2P works
    chosen = {"NCCL_P2P_DISABLE": "0"}
    assert p2p_default(four, 4, chosen) is None and chosen == {"NCCL_P2P_DISABLE": "0"}


def test_every_rank_gets_expandable_segments_unless_the_user_configured_the_allocator() -> None:
    from pipeline.train.runtime.env import allocator_default, recorded

    environ: dict[str, str] = {}
    assert allocator_default(environ) and environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert recorded(environ) == environ  # environment.json keeps it per rank
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the user's own, under either name, is kept
        mine = {name: "max_split_size_mb:512"}
        assert not allocator_default(mine) and mine == {name: "max_split_size_mb:512"}


def test_importing_the_models_prints_no_known_noise() -> None:
    """torchao's optional kernels that do not load here, its note that Triton is absent and torch's deprecation of
    its Enum registration were printed by every command (newcomer trial 4, #83): the package drops exactly those,
    and a warning of its own from the same loggers still shows."""
    import subprocess
    import sys

    code = (
        "import logging, pipeline, transformers.models.llama.modeling_llama\n"
        "logging.getLogger('torchao').warning('another warning of torchao')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for noise in ("Failed to load", "Detected no triton", "is an Enum subclass"):
        assert noise not in r.stderr, r.stderr
    assert "another warning of torchao" in r.stderr
