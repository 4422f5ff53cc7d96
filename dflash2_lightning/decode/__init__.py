"""Decoding with a draft: the speculative loop (greedy and sampled, lossless; its sampling law is
:mod:`dflash2_lightning.model.sampling`), the drafter interface, and the drafting vocabulary."""
