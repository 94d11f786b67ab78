"""Gather a sweep dir into a table (CSV + Markdown), PNG plots and one HTML page; same as ``servelab results``.

    python experiments/collect.py multirun/2026-01-01/12-00-00 [--plot prefix_cache_hit_rate] [--out DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.metrics.results import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
