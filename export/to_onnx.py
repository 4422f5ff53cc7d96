"""Export a trained draft as ONNX drafting graphs (``context``, ``draft_step``) and verify them with onnxruntime.

    python export/to_onnx.py --draft runs/quickstart/train/hf --target smollm2 --out exported/ [--dtype fp16]

The same command as ``dflash2 export-onnx`` (``--help`` lists the options); it needs the package installed
(``pip install -e .`` or ``make install``).
"""

import sys

from dflash2_lightning.cli import main

if __name__ == "__main__":
    sys.exit(main(["export-onnx", *sys.argv[1:]]))
