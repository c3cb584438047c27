"""Kubernetes resource quantities (``64Gi``, ``500M``, ``1e9``) as exact byte counts.

The CRD's ``capacity`` fields are quantities; the operator turns them into bytes
for the agent's configuration, and the CEL rules compare them with Kubernetes'
``quantity()`` library, which the tests emulate with :func:`parse_quantity`.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIX = {
    "": Decimal(1),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30),
    "Ti": Decimal(2**40), "Pi": Decimal(2**50), "Ei": Decimal(2**60),
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9),
    "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18),
}
_RE = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$")


class QuantityError(ValueError):
    """The value is not a Kubernetes quantity."""


def parse_quantity(value: int | float | str) -> Decimal:
    """Exact value of a quantity; raises :class:`QuantityError` on anything else."""
    if isinstance(value, bool):
        raise QuantityError(f"not a quantity: {value!r}")
    if isinstance(value, int | float):
        return Decimal(str(value))
    m = _RE.match(value.strip())
    if not m:
        raise QuantityError(f"not a quantity: {value!r}")
    number, suffix = m.group(1), m.group(2) or ""
    try:
        base = Decimal(number)
        if suffix[:1] in ("e", "E"):
            return base * (Decimal(10) ** int(suffix[1:]))
        return base * _SUFFIX[suffix]
    except (InvalidOperation, KeyError) as exc:
        raise QuantityError(f"not a quantity: {value!r}") from exc


def to_bytes(value: int | float | str) -> int:
    """A quantity as whole bytes (rounded up, a byte cannot be split)."""
    q = parse_quantity(value)
    whole = int(q)
    return whole if whole == q else whole + 1
