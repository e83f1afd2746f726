"""Objects between ranks and from ranks to their parent, as data only.

``_dumps`` writes ``torch.save`` bytes; ``_loads`` reads them back only through
``torch.load(weights_only=True)``, which allows tensors and plain values, plus the data classes of
this project that the bytes name (``_data_class``): never an unrestricted pickle
(docs/security.md). ``gather_objects`` / ``broadcast_object`` carry such bytes in uint8 tensors,
where ``dist.all_gather_object`` would unpickle a peer's bytes without restriction; the sizes the
peers announce are checked before anything of that size is allocated (``_agree_sizes``).

No code of this project runs with the payload's values: the data classes admitted define none
of the hooks unpickling calls (``__post_init__``, ``__setstate__``, ``__new__``, ``__del__``, an
enum's ``_missing_``; ``tests/hostile/test_security.py`` pins it). What does run is the library's
own: a pydantic model inherits ``BaseModel.__setstate__``, which ``weights_only``'s BUILD calls and
which assigns the fields as sent; a dataclass is filled without its ``__init__``. So nothing a peer
sends is re-validated: a config that arrives this way holds whatever values the peer put in it
(``RouterConfig(num_experts=-5)`` loads as such).
"""

from __future__ import annotations

import _compat_pickle
import dataclasses
import enum
import functools
import io
import pickle
import pickletools
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flexdispatch._checks.files import excerpt

__all__ = ["broadcast_object", "gather_objects"]


def _torch_safe_globals() -> dict[str, Any]:
    try:
        from torch._weights_only_unpickler import _get_allowed_globals
    except ImportError:  # another PyTorch: only the weights_only path is used
        return {}
    return dict(_get_allowed_globals())


def _is_data_class(cls: type) -> bool:
    """A class whose instances are plain data: a dataclass, an ``Enum``, a ``NamedTuple`` or a
    pydantic model (never a function, a module, an exception or a class with behaviour of its
    own, such as ``subprocess.Popen`` or ``FlexDispatcher``)."""
    if dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum):
        return True
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return True
    return any(
        base.__name__ == "BaseModel" and base.__module__.startswith("pydantic")
        for base in cls.__mro__
    )


_UNTRUSTED = "flexdispatch.integrations"
"""The plug-ins: their classes never travel between ranks, and their configs check their values
when they are made (``__post_init__``, a hook unpickling would call with a payload's values)."""


def _trusted(module: str) -> bool:
    """``module`` belongs to ``flexdispatch`` (but not to its plug-ins, ``_UNTRUSTED``) or to this
    repository's own ``tests`` package: the ``tests`` beside ``flexdispatch`` in a source checkout
    of this project (a third-party wheel that ships a top-level ``tests`` package is not this
    project's, neither beside an installed ``flexdispatch`` in site-packages nor elsewhere)."""
    top = module.split(".")[0]
    if top == "flexdispatch":
        return module != _UNTRUSTED and not module.startswith(_UNTRUSTED + ".")
    if top != "tests":
        return False
    root = Path(__file__).resolve().parents[2]  # NOTE: flexdispatch/launch/wire.py
    if not _source_checkout(root):
        return False  # NOTE: an installed wheel: root is site-packages, whose `tests` is not ours
    package = sys.modules.get("tests")
    paths = list(getattr(package, "__path__", None) or [])
    return bool(paths) and all(Path(p).resolve() == root / "tests" for p in paths)


@functools.lru_cache(maxsize=4)
def _source_checkout(root: Path) -> bool:
    """``root`` (the folder above ``flexdispatch/``) is this project's source checkout: its
    ``pyproject.toml`` names the project ``flexdispatch`` (site-packages has none)."""
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return re.search(r'^name\s*=\s*"flexdispatch"\s*$', text, re.MULTILINE) is not None


def _data_class(module: str, name: str) -> type | None:
    """The data class (``_is_data_class``) defined as ``name`` in module ``module`` of the
    ``flexdispatch`` package or of this repository's ``tests`` (``_trusted``), already imported
    by this process; None otherwise.

    ``name`` must be the class's own ``__qualname__`` there (``Outer.Inner`` for a nested class):
    a dotted path through something the module imported (``flexdispatch.cli.demo_machine`` +
    ``subprocess.Popen``), a function, a module or a class defined elsewhere is not one.
    """
    root = sys.modules.get(module) if _trusted(module) else None
    first, *rest = name.split(".")
    # NOTE: the module's own namespace, then a class's own attributes: never a step through a
    # module that the trusted one imported, nor a lookup hook (``vars``, not ``getattr``)
    obj: Any = vars(root).get(first) if root is not None else None
    for part in rest:
        obj = vars(obj).get(part) if isinstance(obj, type) else None
    if (
        isinstance(obj, type)
        and obj.__module__ == module
        and obj.__qualname__ == name
        and _is_data_class(obj)
    ):
        return obj
    return None


# Opcodes that name a global: protocol 0-1 spell it in the opcode (GLOBAL, INST); STACK_GLOBAL
# (protocol 4+) takes it from the stack, which torch.save (protocol 2) never writes.
_NAMED_GLOBAL_OPS = frozenset({"GLOBAL", "INST"})
_STACK_GLOBAL_OPS = frozenset({"STACK_GLOBAL", "OBJ"})


def _referenced_globals(data: bytes) -> list[tuple[str, str]]:
    """``(module, name)`` of every global the pickle inside ``torch.save`` bytes names.

    Raises:
        pickle.UnpicklingError: not a ``torch.save`` archive, or a pickle that names a global
            through the stack (``STACK_GLOBAL``, ``OBJ``), which ``_dumps`` never writes.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                raise pickle.UnpicklingError("not one pickle in the archive")
            pkl = z.read(names[0])
        found = []
        for op, arg, _ in pickletools.genops(pkl):
            if op.name in _STACK_GLOBAL_OPS:
                raise pickle.UnpicklingError(f"{op.name} opcode")
            if op.name in _NAMED_GLOBAL_OPS:
                module, _, name = str(arg).partition(" ")
                # NOTE: protocol 2 writes Python 2 names (__builtin__.set), read as pickle does
                if (module, name) in _compat_pickle.NAME_MAPPING:
                    module, name = _compat_pickle.NAME_MAPPING[(module, name)]
                module = _compat_pickle.IMPORT_MAPPING.get(module, module)
                found.append((module, name))
        return found
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as exc:
        raise pickle.UnpicklingError(f"unreadable result archive ({exc})") from None


def _dumps(obj: Any) -> bytes:
    """A rank's result as bytes (``torch.save``: tensors travel as raw storage)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _check_members(data: bytes) -> None:
    """Refuse an archive that would inflate: ``_dumps`` (``torch.save``) writes every member
    stored, uncompressed, so a member compressed by any method, or one whose stated size exceeds
    the bytes received (alone, or all of them together), was not written by it. Only the
    archive's central directory is read: nothing is inflated.

    Raises:
        pickle.UnpicklingError: naming the member.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            members = z.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as exc:
        raise pickle.UnpicklingError(f"a rank's result is not torch.save bytes: {exc}") from None
    if any("/code/" in i.filename or i.filename.endswith("constants.pkl") for i in members):
        raise pickle.UnpicklingError(
            "a rank's result is not torch.save bytes: a TorchScript archive (torch.jit.save), "
            "which is never loaded"
        )
    total = 0
    for info in members:
        name = excerpt(info.filename, 80)
        if info.compress_type != zipfile.ZIP_STORED:
            raise pickle.UnpicklingError(
                f"a rank's result holds a compressed member ({name}, method "
                f"{info.compress_type}), which torch.save never writes: refused before inflating"
            )
        total += info.file_size
        if info.file_size > len(data) or total > len(data):
            raise pickle.UnpicklingError(
                f"a rank's result states {info.file_size} bytes for member {name}, more than "
                f"the {len(data)} bytes received: a forged archive, refused"
            )


def _loads(data: bytes) -> Any:
    """``_dumps``'s bytes back, only ever through ``torch.load(weights_only=True)``: tensors,
    numbers, strings, None and containers, plus the data classes of this project that the
    pickle names (``_data_class``: dataclasses, enums, named tuples, pydantic models), allowed
    for this one load. Never an unrestricted pickle, and never an archive that would inflate
    (``_check_members``: its size is the size of the bytes received).

    Raises:
        pickle.UnpicklingError: naming the first global the pickle refers to that is neither
            allowed by ``weights_only`` nor such a class (``os.system``,
            ``subprocess.Popen``, a function, ...), or a member that is compressed or states a
            size larger than ``data``.
    """
    _check_members(data)
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError:
        pass  # NOTE: a class weights_only does not know: allowed below if it is plain data
    except (RuntimeError, ValueError, EOFError, OSError) as exc:  # e.g. a TorchScript archive
        raise pickle.UnpicklingError(f"a rank's result is not torch.save bytes: {exc}") from None
    allowed = _torch_safe_globals()
    classes: dict[str, type] = {}
    for module, name in _referenced_globals(data):
        key = f"{module}.{name}"
        if key in allowed or key in classes:
            continue
        cls = _data_class(module, name)
        if cls is None:
            raise pickle.UnpicklingError(
                f"a rank's result refers to {excerpt(key, 80)}, which flexdispatch.launch does "
                f"not unpickle: return tensors, numbers, strings, None, lists, tuples and dicts "
                f"(or dataclasses, enums and named tuples of flexdispatch)"
            )
        classes[key] = cls
    with torch.serialization.safe_globals(list(classes.values())):
        return torch.load(io.BytesIO(data), weights_only=True)


def _guard(name: str, group: Any) -> Any:
    from flexdispatch.distributed import collective_guard

    return collective_guard(name, group)


def _collective_device(group: Any) -> torch.device:
    from flexdispatch.distributed import collective_device

    return collective_device(group)


def _size_refusal(
    counts: list[int], what: str, device: torch.device, copies: int, ranks: list[int]
) -> str | None:
    """Why this rank refuses the sizes peers announced (``counts``: bytes of ``ranks``' objects),
    before anything of that size is allocated: a negative one, or ``copies`` buffers of the
    largest that cannot fit in its memory (``flexdispatch._checks.fits``); None when it takes
    them."""
    from flexdispatch._checks import fits

    for rank, count in zip(ranks, counts, strict=True):
        if count < 0:
            return (
                f"{what}: rank {rank} announced {count} bytes: a peer that is not running the "
                f"same flexdispatch (or a corrupted exchange); nothing was allocated"
            )
    largest = max(counts, default=0)
    return fits.refusal(
        what,
        f"rank {ranks[counts.index(largest)]}'s object",
        f"{largest} bytes",
        copies * largest,
        device,
        detail=f"{copies} buffers of the largest size",
        fix="a peer sent more than this rank can hold: return smaller results",
    )


def _agree_sizes(
    counts: list[int],
    what: str,
    device: torch.device,
    copies: int,
    group: Any,
    ranks: list[int] | None = None,
) -> None:
    """``_size_refusal`` on every rank, then agreed on the group (one all-gather of a flag): a
    rank's refusal comes from its own free memory, and a rank that raised alone would leave its
    peers waiting in the next collective until the timeout.

    Raises:
        CollectiveError: on every rank when one refuses: its own reason on a refusing rank, the
            refusing ranks named on the others.
    """
    from flexdispatch.distributed import CollectiveError

    why = _size_refusal(counts, what, device, copies, ranks or list(range(len(counts))))
    flag = torch.tensor([0 if why is None else 1], dtype=torch.int64, device=device)
    flags = [torch.zeros_like(flag) for _ in range(dist.get_world_size(group))]
    with _guard(f"all_gather ({what} size verdicts)", group):
        dist.all_gather(flags, flag, group=group)
    refused = [rank for rank, f in enumerate(flags) if int(f.item())]
    if why is not None:
        raise CollectiveError(f"{why} (refused on rank {dist.get_rank(group)}; every rank raises)")
    if refused:
        raise CollectiveError(
            f"{what}: rank(s) {', '.join(map(str, refused))} cannot hold the objects the peers "
            f"announced ({max(counts, default=0)} bytes at most; see their error): every rank "
            f"raises, nothing was allocated"
        )


def gather_copies(ranks: int) -> int:
    """Buffers of the largest object ``gather_objects`` holds at its peak with ``ranks`` ranks
    (measured: 80 MB per rank on 2 ranks grew the peak by 538 MB, against 400 MB for the
    ``2R + 1`` counted before)."""
    return 3 * ranks + 3


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` on every rank, as ``_dumps`` bytes in uint8 tensors read back with
    ``_loads`` (``dist.all_gather_object`` would unpickle without restriction).

    Raises:
        CollectiveError: a peer failed, or announced a size that some rank cannot hold
            (checked before it is allocated, and agreed: every rank raises, naming the rank
            that refused).
    """
    device = _collective_device(group)
    payload = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
    n = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
    with _guard("all_gather (object sizes)", group):
        dist.all_gather(sizes, n, group=group)
    counts = [int(c.item()) for c in sizes]
    # NOTE: held at the peak: this rank's bytes and their tensor, the padded buffer, one received
    # buffer, one copy of its bytes and one loaded object per rank (3R + 3 of the largest)
    _agree_sizes(counts, "gather_objects", device, gather_copies(len(counts)), group)
    buf = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    buf[: payload.numel()] = payload.to(device)
    bufs = [torch.empty_like(buf) for _ in counts]
    with _guard("all_gather (objects)", group):
        dist.all_gather(bufs, buf, group=group)
    return [_loads(b[:c].cpu().numpy().tobytes()) for b, c in zip(bufs, counts, strict=True)]


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` of rank ``src`` on every rank, the same way as ``gather_objects`` (the size is
    checked the same way: ``CollectiveError``).

    Raises:
        ValueError: ``src`` is not a rank of the group (checked on every rank before any
            collective).
    """
    world = dist.get_world_size(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(f"broadcast_object: src must be a rank in [0, {world}), got {src!r}")
    device = _collective_device(group)
    mine = dist.get_rank(group) == src
    payload = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8) if mine else None
    n = torch.tensor([payload.numel() if payload is not None else 0], device=device)
    with _guard("broadcast (object size)", group):
        dist.broadcast(n, src=src, group=group)
    _agree_sizes([int(n.item())], "broadcast_object", device, 2, group, ranks=[src])
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    if payload is not None:
        buf.copy_(payload)
    with _guard("broadcast (object)", group):
        dist.broadcast(buf, src=src, group=group)
    return _loads(buf.cpu().numpy().tobytes())
