"""What ``flexdispatch.integrations.megatron.install()`` put in place (process-wide by nature: it
rebinds a module global of Megatron's), read by the classes that subclass Megatron's."""

from __future__ import annotations

from typing import Any

MEGATRON: dict[str, Any] = {}
"""``"original"``: Megatron's ``MoEFlexTokenDispatcher``; ``"config"``: the ``DispatchConfig``
that layers built from now on get."""
