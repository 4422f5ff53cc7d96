"""The tiny random target: a seeded ``Qwen3ForCausalLM`` and a BPE tokenizer trained on the built-in corpus.

What tests and CI train against: a real transformers model and a real tokenizer with a chat template,
built in a second with nothing downloaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dflash2_lightning.target.spec import TargetError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Geometry of the tiny random target (Qwen3); ``TargetSpec.tiny`` entries override these.
TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
# Special tokens of the tiny tokenizer, in id order (ChatML-style, like SmolLM2 and Qwen).
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|mask|>")
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


_TOKENIZERS: dict[int, Any] = {}


def tiny_tokenizer(vocab_size: int = 512) -> Any:
    """A deterministic byte-level BPE tokenizer trained on the built-in corpus (cached per process).

    Special tokens (ids 0..4): ``<|endoftext|>`` (eos), ``<|im_start|>``, ``<|im_end|>`` (end of a chat
    turn, also an eos id), ``<|pad|>``, ``<|mask|>``; a ChatML chat template.
    """
    if vocab_size not in _TOKENIZERS:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        from dflash2_lightning.target.corpus import builtin_texts

        floor = len(TINY_SPECIAL_TOKENS) + 256
        if vocab_size < floor:
            raise TargetError(
                f"tiny.vocab_size={vocab_size} is invalid: must be >= {floor} (256 byte tokens + special tokens)"
            )
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(TINY_SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        bpe.train_from_iterator(builtin_texts(), trainer=trainer)
        _TOKENIZERS[vocab_size] = PreTrainedTokenizerFast(
            tokenizer_object=bpe,
            eos_token="<|endoftext|>",
            pad_token="<|pad|>",
            mask_token="<|mask|>",
            chat_template=TINY_CHAT_TEMPLATE,
        )
    return _TOKENIZERS[vocab_size]


def build_tiny(overrides: dict[str, Any], seed: int) -> tuple[PreTrainedModel, Any]:
    """The tiny model (``TINY_DEFAULTS`` with ``overrides``, weights seeded with ``seed``) and its tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kw = {**TINY_DEFAULTS, **overrides}
    tok = tiny_tokenizer(int(kw["vocab_size"]))
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    cfg = Qwen3Config(**kw, pad_token_id=tok.pad_token_id, eos_token_id=eos)
    with torch.random.fork_rng(devices=[]):  # seeded weights without disturbing the caller's RNG
        torch.manual_seed(seed)
        hf = Qwen3ForCausalLM(cfg)
    hf.generation_config.eos_token_id = eos
    hf.generation_config.pad_token_id = tok.pad_token_id
    return hf, tok
