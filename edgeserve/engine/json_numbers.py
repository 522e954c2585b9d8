"""JSON numbers that end: a bound on the digits a constrained answer's numbers may have, beside its grammar.

llguidance's JSON grammars let a number run on (`8.151054975520172308128…` until the length limit). A double
holds 17 significant digits, so more say nothing: each number's mantissa (its integer and fraction digits,
less the lone leading zero of `0.5`) is held to MAX_MANTISSA_DIGITS and its exponent to MAX_EXPONENT_DIGITS.
`NumberScanner` follows an answer's text (outside its strings) and `NumberBound` turns where it stands into
the tokens that would pass the bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

MAX_MANTISSA_DIGITS = 17
MAX_EXPONENT_DIGITS = 3
_DIGITS = frozenset(b"0123456789")
_NUMBER_BYTES = frozenset(b"0123456789.eE+-")
# Where in a number the next byte lands.
INTEGER, FRACTION, EXPONENT = 0, 1, 2


@dataclass
class NumberScanner:
    """Where JSON text stands: inside a string, inside a number (which part, how many digits), or elsewhere."""

    in_string: bool = False
    escaped: bool = False
    in_number: bool = False
    part: int = INTEGER
    mantissa: int = 0
    exponent: int = 0
    leading_zero: bool = False  # the integer part so far is one "0", which does not count

    def feed(self, data: bytes) -> None:
        for byte in data:
            self._byte(byte)

    def _byte(self, byte: int) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif byte == 0x5C:  # backslash
                self.escaped = True
            elif byte == 0x22:  # quote
                self.in_string = False
            return
        if self.in_number and byte in _NUMBER_BYTES:
            self._number_byte(byte)
            return
        self.in_number = False
        if byte == 0x22:
            self.in_string = True
        elif byte == 0x2D or byte in _DIGITS:  # "-" or a digit opens a number
            self.in_number, self.part, self.mantissa, self.exponent, self.leading_zero = True, INTEGER, 0, 0, False
            if byte != 0x2D:
                self._number_byte(byte)

    def _number_byte(self, byte: int) -> None:
        if byte in _DIGITS:
            if self.part == EXPONENT:
                self.exponent += 1
            elif self.part == INTEGER and self.mantissa == 0 and not self.leading_zero and byte == 0x30:
                self.leading_zero = True
            else:
                self.mantissa += 1
        elif byte == 0x2E:  # "."
            self.part = FRACTION
        elif byte in b"eE":
            self.part = EXPONENT


def _added_digits(token: bytes, part: int) -> tuple[int, int]:
    """The mantissa and exponent digits token adds to a number standing in part (up to the number's end)."""
    mantissa = exponent = 0
    for byte in token:
        if byte not in _NUMBER_BYTES:
            break
        if byte in _DIGITS:
            if part == EXPONENT:
                exponent += 1
            else:
                mantissa += 1
        elif byte == 0x2E:
            part = FRACTION
        elif byte in b"eE":
            part = EXPONENT
    return mantissa, exponent


class NumberBound:
    """The vocabulary's tokens sorted by the digits they would add to a number, for masks built in one compare."""

    def __init__(self, token_bytes: Callable[[int], bytes], vocab_size: int):
        added = np.zeros((3, 2, vocab_size), dtype=np.int16)
        for token in range(vocab_size):
            data = token_bytes(token)
            if data and data[0] in _NUMBER_BYTES:
                for part in (INTEGER, FRACTION, EXPONENT):
                    added[part, :, token] = _added_digits(data, part)
        self._added = added

    def forbidden(self, scanner: NumberScanner) -> np.ndarray | None:
        """The tokens that would take the number the text stands in past the bound; None outside a number."""
        if not scanner.in_number:
            return None
        mantissa, exponent = self._added[scanner.part]
        return (mantissa + scanner.mantissa > MAX_MANTISSA_DIGITS) | (exponent + scanner.exponent > MAX_EXPONENT_DIGITS)
