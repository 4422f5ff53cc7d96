"""Build TensorRT engines (with the dflash plugins) from an ONNX export and check them against onnxruntime.

    python export/to_trt.py --onnx exported/ --out engines/ [--batch 1,1,16] [--context 1,256,4096]

The same command as ``dflash2 export-trt`` (``--help`` lists the options); it needs the package installed
(``pip install -e .`` or ``make install``) and, to build, TensorRT and an NVIDIA GPU.
"""

import sys

from dflash2_lightning.cli import main

if __name__ == "__main__":
    sys.exit(main(["export-trt", *sys.argv[1:]]))
