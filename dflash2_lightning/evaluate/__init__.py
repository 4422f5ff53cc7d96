"""τ, measured: the speculative loop's acceptance per path and temperature, the T=0 replay, intervals, reports,
and the llama.cpp evaluation (``dflash2 eval``, :mod:`dflash2_lightning.evaluate.command`); the acceptance
record a served draft must match and ``dflash2 check-serving``, which reads a running engine's own counters
(:mod:`~dflash2_lightning.evaluate.acceptance_record`, :mod:`~dflash2_lightning.evaluate.check_serving`,
:mod:`~dflash2_lightning.evaluate.engine_counters`)."""
