"""``kvstore bench``: kvstore side by side with mlx-lm's prompt-cache files.

One run measures save, restore (page cache and cold), a multi-turn
conversation, many sessions sharing a system prompt, lookup latency as the
entries grow, restore vs recompute on a tiny model, and restore throughput
with several processes — each row with both figures and their ratio. With
``--model`` (``model_cases``) it also measures a real model: time to first token,
restore vs prefill, and a 6-turn conversation against mlx-lm's in-memory cache.
"""

from .cli import GROUPS, main, run
from .common import CONFIGS, FULL, QUICK, SMOKE, Config, Row

__all__ = ["CONFIGS", "FULL", "GROUPS", "QUICK", "SMOKE", "Config", "Row", "main", "run"]
