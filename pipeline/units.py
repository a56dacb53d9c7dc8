"""Amounts people type: sizes in bytes (512MB, 64GiB), network rates (100Gbps). One parser each, for every
command and the hostfiles' `# cluster:` lines."""

from __future__ import annotations


def parse_size(text: str) -> int:
    """'512MB' -> bytes (decimal units, and KiB/MiB/GiB binary ones)."""
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
        "K": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
    }
    s = text.strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num) :]
    try:
        if unit not in units:
            raise ValueError
        return int(float(num) * units[unit])
    except ValueError:
        raise ValueError(f"'{text}': expected a size such as 512MB, 2GB or 64GiB") from None


def parse_gbps(text: str) -> float:
    """'100Gbps' (or '100gb/s', '100') -> 100.0 gigabits per second; ValueError when it is not a positive amount."""
    s = text.strip().lower().replace(" ", "")
    for unit in ("gbps", "gbit/s", "gb/s"):
        s = s.removesuffix(unit)
    try:
        value = float(s)
    except ValueError:
        raise ValueError(f"'{text}': expected a network rate such as 100Gbps") from None
    if not value > 0:
        raise ValueError(f"'{text}': expected a positive rate such as 100Gbps")
    return value
