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


def parse_count(text: str, what: str = "tokens") -> float:
    """'1B', '100bn', '500M', '2T', '512K', '4M', '1.5e9' -> a count (decimal: K 1e3, M 1e6, B/bn/G 1e9, T 1e12);
    ValueError naming `what` when it is not one."""
    s = text.strip().lower().replace(" ", "").replace("_", "").replace(",", "")
    scale = {"k": 1e3, "m": 1e6, "mn": 1e6, "b": 1e9, "bn": 1e9, "g": 1e9, "t": 1e12, "tn": 1e12}
    num = s.rstrip("kmbgtn")
    unit = s[len(num) :]
    try:
        if unit and unit not in scale:
            raise ValueError
        return float(num) * scale.get(unit, 1.0)
    except ValueError:
        raise ValueError(f"'{text}': expected a number of {what} such as 1B, 100bn, 500M or 4M") from None
