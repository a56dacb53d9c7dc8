"""Amounts people type: sizes in bytes (512MB, 64GiB), network rates (100Gbps). One parser each, for every
command and the hostfiles' `# cluster:` lines."""

from __future__ import annotations


def parse_size(text: str) -> int:
    """'512MB' -> bytes (decimal units, and KiB/MiB/GiB binary ones). A bare number is refused: '512' meant as
    megabytes would be 512 bytes (a shard size of 512 bytes writes a file per sample); '512B' says bytes."""
    units = {
        "": 1,  # a bare number: refused below unless 0
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
        value = int(float(num) * units[unit])
    except ValueError:
        raise ValueError(f"'{text}': expected a size such as 512MB, 2GB or 64GiB") from None
    if not unit and value:
        raise ValueError(f"'{text}': a size needs its unit, e.g. {text}MB, {text}GB or {text}B for bytes")
    return value


def format_size(n: float) -> str:
    """Bytes as a person reads them: 2.6 MB, 41.0 GB, 1.2 TB (decimal units, as disks are sold and `df -H` says)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:.0f} bytes"


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


def parse_length(text: str) -> int:
    """A sequence length in tokens: 4096, or with a k/K/M suffix in powers of two (32k = 32,768 and 128K =
    131,072, as sequence lengths are counted); ValueError when it is neither."""
    scale = {"k": 1024, "m": 1024**2}.get(text[-1:].lower(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def parse_length_mix(spec: str | None) -> tuple[tuple[int, float], ...]:
    """`--length-mix 8192:2,32768:4` as ((8192, 2.0), (32768, 4.0)); lengths take k/K/M suffixes (8k = 8192,
    token counts are powers of two as seq_len is); ValueError naming the part that is not LENGTH:WEIGHT."""
    if not spec:
        return ()
    out = []
    for part in spec.split(","):
        length, sep, weight = part.strip().partition(":")
        if not sep:
            raise ValueError(f"--length-mix {spec}: '{part}' has no weight; give LENGTH:WEIGHT, e.g. {part}:2")
        try:
            out.append((parse_length(length), float(weight)))
        except ValueError:
            raise ValueError(
                f"--length-mix {spec}: '{part}' is not LENGTH:WEIGHT (a token count and a weight), e.g. 8192:2 or 8k:2"
            ) from None
    return tuple(out)
