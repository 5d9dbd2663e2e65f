"""The upkeep of the root: garbage collection as a plan, sweeping, verification and repair,
and the batched access stamps that order evictions."""
