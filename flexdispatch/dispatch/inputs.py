"""The checks ``FlexDispatcher`` runs on a call's inputs before any collective: metadata (shapes,
dtypes, devices, the row limits of ``_checks.fits``, a caller's layout), then values as
``values.screen_dispatch_values`` decides (raise now, screen on the device, or leave them to a
backend that counts bad ids itself), and the bad ids a backend counted itself, logged without a
launch. A mixin of ``dispatcher.FlexDispatcher``: it reads the dispatcher's config, backend and
statistics.

Shape letters (ARCHITECTURE.md): T tokens on this rank · H hidden · E experts in total · R ranks ·
k top-k.
"""

from __future__ import annotations

import torch

from flexdispatch._checks import fits, tensors
from flexdispatch.dispatch import values as bad_values
from flexdispatch.dispatch.autograd import ROW_DTYPES, Rows
from flexdispatch.types import DispatchLayout

__all__ = ["InputChecks"]


class InputChecks:
    """Input checks of ``FlexDispatcher`` (a mixin)."""

    def _check_device(self, name: str, t: torch.Tensor) -> None:
        """Raise ValueError (before any collective) for a tensor the group cannot move."""
        if t.device.type == "meta":
            raise ValueError(
                f"{name} is on the meta device (shapes only, no data): dispatch and combine move "
                f"real rows; pass a tensor on {self._comm_device.type}"
            )
        if self._comm_device.type == "cuda" and t.device.type != "cuda":
            raise ValueError(
                f"{name} is on {t.device} but the process group (NCCL) moves CUDA tensors: move "
                f"it with .to('cuda')"
            )

    def _check_inputs(
        self,
        x: Rows,
        topk_idx: torch.Tensor,
        topk_probs: torch.Tensor,
        layout: DispatchLayout | None,
    ) -> torch.Tensor:
        """Check the inputs (metadata, then values as ``_check_values``); returns the ids to
        dispatch (bad ones as -1 where they are screened on the device)."""
        values = x  # what the non-finite check reads (fp8 rows: their float32 scales)
        fp8 = isinstance(x, tuple)
        if isinstance(x, tuple):
            x = tensors.check_fp8_rows(x, self.backend_name)
            values = values[1]
        tensors.check_routing(x, topk_idx, topk_probs, needs_topk=True)
        if not fp8 and x.dtype not in ROW_DTYPES:
            raise TypeError(
                f"x must be bfloat16, float16 or float32, got "
                f"{str(x.dtype).replace('torch.', '')}: convert it with x.to(torch.bfloat16) "
                f"or x.float() (or pass an (fp8 rows, scales) tuple to the deepep backend)"
            )
        T = x.shape[0]
        self._check_device("x", x)
        H = self.config.hidden_size
        if H and x.shape[1] != H:
            raise ValueError(
                f"x has hidden size {x.shape[1]} but DispatchConfig.hidden_size={H}: pass rows "
                f"of the hidden size the config names (or build the dispatcher with "
                f"hidden_size={x.shape[1]}, or None)"
            )
        fits.check_dispatch_rows(
            x, topk_idx.shape[1], self.num_ranks, self.num_experts, self.config.num_worst_tokens,
            self.backend_name, self.ranks_per_node if self.config.hierarchical else 0,
        )  # fmt: skip
        if layout is not None:
            mask = layout.is_token_in_rank
            if tuple(mask.shape) != (T, self.num_ranks) or mask.dtype != torch.bool:
                raise ValueError(
                    f"layout.is_token_in_rank must be a [{T}, {self.num_ranks}] bool tensor, got "
                    f"{tuple(mask.shape)} {mask.dtype}: build the layout with "
                    f"get_dispatch_layout(topk_idx, num_experts, num_ranks)"
                )
        return self._check_values(topk_idx, values, topk_probs)

    def _check_values(
        self, topk_idx: torch.Tensor, values: torch.Tensor, topk_probs: torch.Tensor
    ) -> torch.Tensor:
        """The ids the backend gets (``values.screen_dispatch_values``: raise now, screen on the
        device, or, checks off, leave them to a backend that counts bad ids itself)."""
        return bad_values.screen_dispatch_values(
            topk_idx,
            self.num_experts,
            values,
            topk_probs,
            checks=self._checks,
            counts_bad_ids=self._backend.counts_bad_ids,
            log=self._bad_log,
            stats=self._stats,
        )

    def _log_bad_ids(self) -> None:
        """Count the ids outside ``[-1, E)`` the backend's last dispatch counted (checks off:
        ``DispatchBackend.bad_ids``), without a launch."""
        bad = self._backend.bad_ids
        if bad is not None:
            count, lowest, highest = bad
            zero = self._zero
            if zero is None or zero.device != count.device:
                zero = self._zero = torch.zeros((), dtype=torch.int64, device=count.device)
            self._bad_log.add(self._stats, (count, zero, zero, zero, highest, lowest))
