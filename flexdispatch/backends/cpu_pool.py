"""Re-export of ``flexdispatch._memory``'s CPU output pool (it moved to the bottom layer so that
``permutation`` can lend its outputs from the same pool)."""

from flexdispatch._memory import MAX_ENTRIES, MIN_BYTES, OUTPUT_POOL, CpuOutputPool

__all__ = ["CpuOutputPool", "OUTPUT_POOL", "MIN_BYTES", "MAX_ENTRIES"]
