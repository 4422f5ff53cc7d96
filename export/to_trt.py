"""Build TensorRT engines from the exported drafting graphs and check them against onnxruntime.

    python export/to_trt.py --onnx <export dir or .onnx file> --out <engine file or dir>
                            [--graph draft_step] [--batch 1,1,16] [--context 1,256,4096]
                            [--dim NAME=min,opt,max ...] [--timing-cache FILE] [--no-compare]

The code lives in ``dflash2_lightning.tensorrt`` (``build.py``: options, exit codes, what needs a GPU);
this script only runs it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

from dflash2_lightning.tensorrt.build import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
