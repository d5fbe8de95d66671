"""The tools around the library: the benchmark harness (``collectives-bench``,
:mod:`.bench`), the simulator's command line (``python -m collectives.tools.sim``), the
multi-host testbed (:mod:`.testbed`), the soak (:mod:`.soak`) and the demo (:mod:`.demo`)."""
