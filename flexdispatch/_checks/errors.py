"""Bad-input errors that keep their parts, so that the command line can print each as one short
line (``flexdispatch.cli._common.format_error``) while the API keeps its whole message.

``InputError`` is a ``ValueError`` (whoever catches ``ValueError`` still does) and ``str()`` of it
is the whole message, as the API has always said it. Its parts:

- ``option``: what the user changes, where the library knows it better than its caller (an
  environment variable ``$NAME``, ``ulimit -v``); empty otherwise, and the command line names the
  option that fed the call (``flexdispatch.cli._common.option_scope``);
- ``value``: the bad value (``has_value`` says whether one was given);
- ``problem``: what is wrong, short (``needs ~58.1 GiB, 15.8 GiB available``);
- ``fix``: what to do, in the imperative, at most ``MAX_FIX`` characters;
- ``detail``: how the problem was worked out (an estimate's parts, a whole path): the command line
  shows it with ``--verbose`` only;
- ``arg``: the API argument at fault (``num_experts``), for a caller that maps it to its own
  option (``option_scope(..., args=...)``).

``MemoryRefusal`` is the refusal of an estimate that does not fit
(``flexdispatch._checks.fits.check_fits``), with the numbers.

No torch import (the command line's parent process raises these before it imports torch).
"""

from __future__ import annotations

__all__ = ["MAX_FIX", "InputError", "MemoryRefusal"]

MAX_FIX = 80
"""Longest ``fix`` (the command line never cuts it: a line of 200 characters must hold it)."""

_UNSET = object()


class InputError(ValueError):
    """A bad input value, with its parts (see the module docstring).

    Args:
        message: the whole message (``str(exc)``); default: the parts joined,
            ``OPTION=VALUE: PROBLEM (DETAIL): FIX``.
        option / value / problem / fix / detail / arg: the parts.
    """

    def __init__(
        self,
        message: str = "",
        *,
        option: str = "",
        value: object = _UNSET,
        problem: str = "",
        fix: str = "",
        detail: str = "",
        arg: str = "",
    ) -> None:
        self.option = option
        self.arg = arg
        self.value = None if value is _UNSET else value
        self.has_value = value is not _UNSET
        self.problem = problem
        self.fix = fix
        self.detail = detail
        if not message:
            subject = f"{option}={self.value}" if option and self.has_value else option
            message = ": ".join(
                p for p in (subject, problem + (f" ({detail})" if detail else ""), fix) if p
            )
        super().__init__(message)


class MemoryRefusal(InputError):
    """An estimate that does not fit (``fits.check_fits``): ``arg=value`` needs ``nbytes`` and
    ``usable`` bytes (``SHARE`` of ``avail``, from ``source``) are available."""

    def __init__(
        self,
        message: str,
        *,
        arg: str,
        value: object,
        nbytes: int,
        usable: int,
        avail: int,
        source: str,
        problem: str,
        fix: str = "",
        detail: str = "",
        option: str = "",
    ) -> None:
        super().__init__(
            message, option=option, value=value, problem=problem, fix=fix, detail=detail, arg=arg
        )
        self.nbytes = nbytes
        self.usable = usable
        self.avail = avail
        self.source = source
