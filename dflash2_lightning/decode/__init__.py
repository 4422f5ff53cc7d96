"""Decoding with a draft: the speculative loop (greedy and sampled, lossless), its sampling law, the drafter
interface, and the drafting vocabulary."""
