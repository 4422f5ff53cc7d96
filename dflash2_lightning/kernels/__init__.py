"""Triton kernels for the custom ops (optional ``kernels`` extra); see ``dflash2_lightning.ops``."""

cuda_block_conv = None
cuda_lattice_walk = None
