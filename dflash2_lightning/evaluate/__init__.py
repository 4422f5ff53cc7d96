"""τ, measured: the speculative loop's acceptance per path and temperature, the T=0 replay, intervals, reports,
and the llama.cpp evaluation (``dflash2 eval``, :mod:`dflash2_lightning.evaluate.command`)."""
