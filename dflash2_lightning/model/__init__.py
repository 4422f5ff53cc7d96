"""The draft model: DFlash backbone, DFlash2 convolution and candidate selector, the drafting cache, the draft's
on-disk format (:mod:`~dflash2_lightning.model.checkpoint`) and the sampling law
(:mod:`~dflash2_lightning.model.sampling`)."""

from dflash2_lightning.model.backbone import CacheSlot, ContextKV, ContextStates, LayerKV
from dflash2_lightning.model.cache import DraftCache
from dflash2_lightning.model.conv import DFlashGroupedConv
from dflash2_lightning.model.draft import DraftModel
from dflash2_lightning.model.selector import CandidateSelector

__all__ = [
    "CacheSlot",
    "CandidateSelector",
    "ContextKV",
    "ContextStates",
    "DraftCache",
    "DFlashGroupedConv",
    "DraftModel",
    "LayerKV",
]
