"""The planner's row and byte accounting: the names of ``flexdispatch.traffic``, which holds them
at the bottom of the package so that the backends (which report the same figures in ``stats``) can
import them without reaching up into the planner."""

from flexdispatch.traffic import (
    TORCH_META_BYTES_PER_SLOT,
    LinkRows,
    RowFormat,
    SourceRows,
    count_rows_batched,
    count_source_rows,
    deepep_row_format,
    link_rows,
    torch_row_format,
)

__all__ = [
    "SourceRows",
    "LinkRows",
    "RowFormat",
    "count_source_rows",
    "count_rows_batched",
    "link_rows",
    "torch_row_format",
    "deepep_row_format",
    "TORCH_META_BYTES_PER_SLOT",
]
