"""Typed reads of values, one rule for every reader: the public functions' int arguments
(``check_int``), the configs' pydantic validators (``flexdispatch.config``), the Hugging Face
importer (``importers._keys``), the Megatron importer (``importers.megatron``) and integer
environment variables (``env_int``: the launcher's, ``$FLEXDISPATCH_THREADS``,
``$FLEXDISPATCH_VISIBLE_GPUS``; no torch import, so the launch recipes' device check stays
light).

- A bool is never a number (YAML reads ``yes`` / ``on`` as true; Python's ``True == 1``).
- A float is finite (an infinite loss coefficient turns the gradients into NaN).
- A message shows a value short and escaped (``show``: never a whole line of a file).
"""

from __future__ import annotations

import math
import os
from typing import Any

from flexdispatch._checks.errors import InputError
from flexdispatch._checks.files import excerpt

__all__ = ["check_int", "env_int", "finite", "integer", "not_bool", "show"]


def show(value: Any) -> str:
    """A config value in a message, with its type: short non-strings as Python writes them,
    anything else as a short escaped excerpt (``files.excerpt``)."""
    text = repr(value)
    if isinstance(value, str) or len(text) > 24:
        text = excerpt(value)
    return f"{text} ({type(value).__name__})"


def not_bool(value: object) -> object:
    """``value`` unchanged, or ValueError for a bool (a pydantic ``BeforeValidator``: its lax
    mode reads True as 1, and YAML reads yes/on/true as True)."""
    if isinstance(value, bool):
        raise ValueError(
            f"{str(value).lower()} is not a number (YAML also reads yes/no and on/off as "
            f"true/false): write the number"
        )
    return value


def check_int(
    name: str,
    value: Any,
    *,
    at_least: int | None = None,
    at_most: int | None = None,
    rule: str | None = None,
    error: type[Exception] = ValueError,
    show_type: bool = False,
) -> int:
    """``value`` if it is an int in ``[at_least, at_most]``, else raise naming ``name``: the one
    int check of every argument and config reader (a bool is not an int, nor is ``2.0`` or
    ``'8'``).

    Args:
        rule: what the message says ``value`` must be (e.g. ``"a positive int"``), for a wrong
            type and a wrong value alike; default: ``an int``, then its range.
        error: raised for a value that is not an int (``TypeError`` for an argument of a wrong
            type; ``ValueError`` where the caller's contract says so). Out of range: ValueError.
        show_type: show the value with its type (``show``), as config readers do.
    """
    got = show(value) if show_type else repr(value)
    if isinstance(value, bool) or not isinstance(value, int):
        if rule is not None:
            raise error(f"{name} must be {rule}, got {got}")
        raise error(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if (at_least is not None and value < at_least) or (at_most is not None and value > at_most):
        if rule is not None:
            raise ValueError(f"{name} must be {rule}, got {got}")
        if at_most is None:
            raise ValueError(f"{name} must be >= {at_least}, got {value}")
        if at_least is None:
            raise ValueError(f"{name} must be <= {at_most}, got {value}")
        raise ValueError(f"{name} must be in [{at_least}, {at_most}], got {value}")
    return value


def integer(value: Any, name: str, *, why: str = "") -> int:
    """``value`` as an int, or ValueError naming ``name`` (``check_int``; ``why`` is appended to
    the rule, e.g. who reads it so)."""
    return check_int(name, value, rule=f"an integer{why}", show_type=True)


def finite(value: Any, name: str, *, strings: bool = False) -> float:
    """``value`` as a finite float, or ValueError naming ``name``: a bool, NaN, Infinity, 1e400,
    an integer too large for a float; a string unless ``strings`` (then one ``float()`` reads:
    ``'1e-2'``, as argparse's ``type=float`` reads it)."""
    given = value
    if strings and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {show(given)}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {show(given)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        shown = (
            show(given)
            if isinstance(given, (float, str))
            else f"an integer of {len(str(value))} digits"
        )
        raise ValueError(f"{name} must be a finite number, got {shown}")
    return number


def env_int(
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    fix: str = "fix the launcher environment",
) -> int | None:
    """The integer in environment variable ``name`` (ASCII digits: ``int()`` also reads ``'٢'``),
    or None when it is unset or empty.

    Raises:
        ValueError: naming the variable (an ``InputError`` whose option is ``$NAME``), when it is
            not an integer or is outside ``[minimum, maximum]``; ``fix`` says what to do.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        if not text.isascii():
            raise ValueError(text)
        value = int(text)
    except ValueError:
        raise InputError(
            f"${name}={excerpt(text)} is not an integer: {fix}",
            option=f"${name}",
            value=text,
            problem="is not an integer",
            fix=fix,
        ) from None
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        lo = "" if minimum is None else f">= {minimum}"
        hi = "" if maximum is None else f"<= {maximum}"
        bounds = " and ".join(b for b in (lo, hi) if b)
        raise InputError(
            f"${name}={value} must be {bounds}: {fix}",
            option=f"${name}",
            value=value,
            problem=f"must be {bounds}",
            fix=fix,
        )
    return value
