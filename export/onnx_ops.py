"""The ``dflash`` ONNX domain (version 1): op schemas, export translation table, reference bodies.

    python export/onnx_ops.py            # print the op contract and the reference bodies' sizes

The code lives in ``dflash2_lightning.onnx.ops``; this file re-exports it for scripts in ``export/``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

from dflash2_lightning.onnx.ops import *  # noqa: E402,F401,F403
from dflash2_lightning.onnx.ops import DEFAULT_CONTRACT_OPSET, describe_contract  # noqa: E402

if __name__ == "__main__":
    print(describe_contract(DEFAULT_CONTRACT_OPSET))
