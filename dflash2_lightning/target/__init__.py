"""The frozen target: its spec, loading (HF directory, GGUF, tiny random), features and head, CPU linears, and the
built-in corpus the tiny target's tokenizer is trained on."""

from dflash2_lightning.target.load import clear_target_cache, load_target
from dflash2_lightning.target.spec import TargetSpec
from dflash2_lightning.target.target import Target, TargetOutput

__all__ = ["Target", "TargetOutput", "TargetSpec", "load_target", "clear_target_cache"]
