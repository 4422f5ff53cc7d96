"""Export a draft as ONNX drafting graphs (``context``, ``draft_step``) and verify them with onnxruntime.

    python export/to_onnx.py --draft <hf dir> --target <hf dir | .gguf | smollm2 | tiny> --out <dir> \
        [--dtype fp32|fp16|bf16] [--opset 20]

The code lives in ``dflash2_lightning.onnx`` (see ``cli.py`` there); this script only runs it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

from dflash2_lightning.onnx.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
