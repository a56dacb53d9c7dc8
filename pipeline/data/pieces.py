"""Long documents in pieces: a document larger than a piece is encoded piece by piece (spread over the workers,
memory bounded by the piece size), at cut points where this tokenizer gives the same ids as for the whole text.

The rule, exactly: a cut goes either right after a run of newlines and before a character that is not whitespace
("newline"), or right before a single space that sits between two characters that are not whitespace ("space").
A rule is used only if the tokenizer gives identical ids across such cuts in a fixed probe text (English, Chinese,
emoji, code): sentencepiece models trained here (no dummy prefix, identity normalisation) and GPT-style byte BPE
pass both; a tokenizer that prefixes every text with a space marker (Llama-2's) passes neither, and its documents are
then encoded whole, as before. Where no permitted cut exists within `HARD_MAX_CHARS` (one 64M-character line), the
piece is cut at that size anyway and counted in the manifest as an unchecked cut (ids may differ within a token of it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

PIECE_CHARS = 1 << 20  # about 1-4 MB of UTF-8: a piece, and a unit of work for the encoders
HARD_MAX_CHARS = 64 << 20

_PROBE = (
    "The quick brown fox jumps over the lazy dog. It was the best of times,\nit was the worst of times.\n\n"
    "  Indented line with  two spaces and tabs\there.\n"
    "春天来了，花园里的花都开了。\n我们去公园散步吧！\n\n混合 mixed 文本 text 2026年11月30日。\n"
    "Emoji 🙂🚀 and flags 🇨🇳 in the middle 👍 of words.\n"
    "def f(x):\n    return x ** 2  # square\n\nprint(f(12345))\n"
)

_NEWLINE_CUT = re.compile(r"(?<=\n)(?=[^\s])")
_SPACE_CUT = re.compile(r"(?<=[^\s]) (?=[^\s])")


def cut_positions(text: str, rule: str) -> Iterator[int]:
    """Positions where `rule` allows a cut (the second piece starts at the position)."""
    if rule == "newline":
        yield from (m.start() for m in _NEWLINE_CUT.finditer(text))
    elif rule == "space":
        yield from (m.start() for m in _SPACE_CUT.finditer(text))


def safe_rules(encode: Callable[[str], list[int]]) -> tuple[str, ...]:
    """The cut rules under which `encode` gives the same ids for the pieces as for the whole probe text."""
    whole = encode(_PROBE)
    ok = []
    for rule in ("newline", "space"):
        cuts = list(cut_positions(_PROBE, rule))
        if cuts and all(encode(_PROBE[:c]) + encode(_PROBE[c:]) == whole for c in cuts):
            ok.append(rule)
    return tuple(ok)


class Cutter:
    """Cuts a stream of text blocks of one document into pieces of about `piece_chars`, at the last permitted cut
    point before the limit. `feed` returns the pieces ready; `end` returns the rest."""

    def __init__(self, rules: tuple[str, ...], piece_chars: int = PIECE_CHARS, hard_max: int = HARD_MAX_CHARS):
        self.rules, self.piece_chars, self.hard_max = rules, piece_chars, hard_max
        self.buf = ""
        self.unchecked = 0

    def feed(self, block: str) -> list[str]:
        if not self.rules:
            self.buf += block  # no safe cut for this tokenizer: the document stays whole
            return []
        self.buf += block
        out = []
        while len(self.buf) > self.piece_chars:
            cut = self._last_cut(self.buf, self.piece_chars)
            if cut is None:
                if len(self.buf) < self.hard_max:
                    break  # wait for a permitted cut
                cut = self.hard_max
                self.unchecked += 1
            out.append(self.buf[:cut])
            self.buf = self.buf[cut:]
        return out

    def end(self) -> str:
        rest, self.buf = self.buf, ""
        return rest

    def _last_cut(self, text: str, limit: int) -> int | None:
        """The last permitted cut at or below `limit`: a newline cut when one is in the second half, else the
        last cut of any permitted rule."""
        window = text[: limit + 1]
        last = {rule: max((p for p in cut_positions(window, rule) if 0 < p <= limit), default=0) for rule in self.rules}
        if last.get("newline", 0) > limit // 2:
            return last["newline"]
        best = max(last.values(), default=0)
        return best or None
