"""dflash2-lightning: train DFlash2 speculative-decoding drafters with Lightning, export to ONNX / TensorRT."""

from dflash2_lightning.config import DraftConfig

__all__ = ["DraftConfig"]
__version__ = "0.1.0"
