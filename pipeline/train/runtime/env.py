"""The environment every rank runs with: DeepSpeed's `.deepspeed_env` files and the settings consumer GPUs need.

DeepSpeed's launcher reads `.deepspeed_env` (in the home folder, then the launch folder; DS_ENV_FILE names
another) only when it reaches hosts through pdsh or MPI, so a one-node launch (`--num_gpus 4`), `--no_ssh` and
`pipeline evaluate --num-gpus` ran without the NCCL settings `pipeline doctor --write-env` put there. Every rank
applies the files itself, before its process group starts; a variable already set in its environment is kept.
Standard library only: the doctor reads the same files."""

from __future__ import annotations

import os
import socket
from pathlib import Path

RECORDED_PREFIXES = (
    "NCCL_",
    "GLOO_",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "TORCH_EXTENSIONS_DIR",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
)
"""Variables recorded per rank in RUN_DIR/environment.json."""


def env_file_paths() -> list[Path]:
    """The .deepspeed_env files DeepSpeed's launcher reads (home, then this folder; DS_ENV_FILE names them)."""
    name = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    return [Path(p) / name for p in (os.path.expanduser("~"), ".")] if not os.path.isabs(name) else [Path(name)]


def read_env_files(paths: list[Path] | None = None) -> dict[str, str]:
    """KEY=VALUE lines of the env files, a later file overriding an earlier one (as DeepSpeed reads them)."""
    found: dict[str, str] = {}
    for path in paths if paths is not None else env_file_paths():
        if path.is_file():
            for line in path.read_text().splitlines():
                key, sep, value = line.partition("=")
                if sep and key.strip():
                    found[key.strip()] = value.strip()
    return found


def apply_env_files(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """Set what the env files say where `environ` does not say otherwise; returns what was set."""
    applied = {k: v for k, v in read_env_files().items() if k not in environ}
    environ.update(applied)
    return applied


def p2p_default(
    gpu_names: list[str], local_ranks: int, environ: dict[str, str] | os._Environ[str] = os.environ
) -> str | None:
    """NCCL_P2P_DISABLE=1 for several GeForce cards on one node unless the user chose: NCCL's P2P path hangs or
    returns garbage on them with the stock driver (DeepSpeed #4433, nccl-tests #117). Returns the note to log."""
    if local_ranks < 2 or "NCCL_P2P_DISABLE" in environ or not any("GeForce" in n for n in gpu_names):
        return None
    environ["NCCL_P2P_DISABLE"] = "1"
    return (
        f"{local_ranks} ranks on GeForce cards ({gpu_names[0]}) on {socket.gethostname()}: NCCL_P2P_DISABLE=1 "
        "(peer-to-peer hangs on consumer cards, DeepSpeed #4433); set NCCL_P2P_DISABLE=0 to try it"
    )


ALLOCATOR_DEFAULT = "expandable_segments:True"
"""The caching allocator's setting for every rank: at 32K every activation is a 0.25-1.75 GiB block, and fixed-size
segments leave such blocks' holes unusable for the next size (Arctic Long Sequence Training sets the same)."""


def allocator_default(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the user set the allocator's configuration (either
    name); before anything touches CUDA (torch reads it when CUDA initialises). True when set here."""
    if "PYTORCH_CUDA_ALLOC_CONF" in environ or "PYTORCH_ALLOC_CONF" in environ:
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_DEFAULT
    return True


def recorded(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    return {k: v for k, v in sorted(environ.items()) if k.startswith(RECORDED_PREFIXES)}
