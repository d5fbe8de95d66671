"""The benchmark harness: ``python -m collectives.tools.bench`` or ``collectives-bench``.

Modules: ``cases`` (one collective at one size: buffers, contenders, check),
``timing`` (warm-up, iteration counts, interleaved rounds, statistics over ranks),
``report`` (table, JSON, CSV, plot), ``tune`` (rows to a tuning table for ``auto``),
``cli`` (options and the sweep).
"""
