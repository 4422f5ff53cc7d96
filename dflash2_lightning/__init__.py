"""dflash2-lightning: train DFlash2 speculative-decoding drafters with Lightning, export to ONNX / TensorRT."""

from dflash2_lightning.config import ConfigError, DraftConfig

__all__ = ["ConfigError", "DraftConfig"]
__version__ = "0.1.0"
