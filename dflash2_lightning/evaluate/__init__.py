"""τ, measured: the speculative loop's acceptance per path and temperature, the T=0 replay, reports, and the
llama.cpp evaluation (``dflash2 eval``, :mod:`dflash2_lightning.evaluate.command`); making the acceptance record
a served draft must match (:mod:`~dflash2_lightning.evaluate.record`; its file and ``dflash2 check-serving`` are
:mod:`dflash2_lightning.engines`)."""
