"""Drafting latency: torch eager vs onnxruntime (CPU), and TensorRT / CUDA kernels where a GPU exists.

    python export/bench.py [--full] [--batches 1,8] [--contexts 256,1024,4096] [--layers 5]

The code lives in ``dflash2_lightning.onnx.bench``; this script only runs it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

from dflash2_lightning.onnx.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
