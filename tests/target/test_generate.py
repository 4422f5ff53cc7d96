"""Batched generation for regeneration: greedy equals one-prompt-at-a-time greedy, sampled responses
depend only on (prompt, seed), finished rows leave the batch without changing the others, and the
sampling filters keep exactly the tokens they should."""

from __future__ import annotations

import json

import pytest
import torch
from speculative_helpers import tiny_target

from dflash2_lightning.data.prompts import SEED_PROMPTS, encode_prompt, read_prompts
from dflash2_lightning.data.regen import regen
from dflash2_lightning.decode.speculative import target_greedy
from dflash2_lightning.model.sampling import Sampling, probabilities
from dflash2_lightning.target.generate import generate


def _prompts(target, n: int) -> list[list[int]]:
    return [encode_prompt(target.tokenizer, m) for m in read_prompts(SEED_PROMPTS, n)]


def _gen(target, prompts, new, sampling=Sampling(), seeds=None):
    return generate(target.hf, prompts, new, target.eos_token_ids, target.tokenizer.pad_token_id, sampling, seeds)


def test_batched_greedy_equals_single_prompt_greedy() -> None:
    target = tiny_target()
    prompts = _prompts(target, 5)
    batched = _gen(target, prompts, 12)
    for p, got in zip(prompts, batched):
        assert got == target_greedy(target, p, 12, target.eos_token_ids).tokens


def test_sampled_rows_depend_only_on_their_seed() -> None:
    target = tiny_target()
    prompts = _prompts(target, 4)
    sampling = Sampling(temperature=1.0)
    together = _gen(target, prompts, 10, sampling, seeds=[11, 12, 13, 14])
    alone = [_gen(target, [p], 10, sampling, seeds=[s])[0] for p, s in zip(prompts, [11, 12, 13, 14])]
    assert together == alone
    again = _gen(target, prompts[::-1], 10, sampling, seeds=[14, 13, 12, 11])
    assert again == together[::-1]
    other = _gen(target, prompts, 10, sampling, seeds=[21, 22, 23, 24])
    greedy = _gen(target, prompts, 10)
    assert other != together and together != greedy  # a random tiny target at T=1 samples, it does not argmax


def test_eos_rows_leave_the_batch_without_changing_the_rest() -> None:
    target = tiny_target()
    prompts = _prompts(target, 6)
    eos = target.eos_token_ids
    out = _gen(target, prompts, 16, Sampling(temperature=2.0), seeds=list(range(6)))
    for tokens in out:
        stops = [i for i, t in enumerate(tokens) if t in eos]
        assert not stops or stops[0] == len(tokens) - 1  # a response ends at its first eos
    # Make "every token that row 0 emitted first" an eos: row 0 stops at once, the others must not move.
    first = out[0][0]
    short = generate(
        target.hf,
        prompts,
        16,
        list(eos) + [first],
        target.tokenizer.pad_token_id,
        Sampling(temperature=2.0),
        list(range(6)),
    )
    assert short[0] == [first]
    for full, cut in zip(out[1:], short[1:]):
        stop = next((i for i, t in enumerate(full) if t == first), None)
        assert cut == (full if stop is None else full[: stop + 1])


def test_filters_keep_the_right_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.allclose(probabilities(logits, Sampling(temperature=1.0)), logits.exp())
    top2 = probabilities(logits, Sampling(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]]))
    # top-p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so the third token (mass before it 0.7) stays; the fourth does not.
    nucleus = probabilities(logits, Sampling(temperature=1.0, top_p=0.8))
    assert torch.allclose(nucleus, torch.tensor([[0.5, 0.2, 0.15, 0, 0]]) / 0.85)
    # The most likely token always survives, however small top_p.
    assert torch.equal(
        probabilities(logits, Sampling(temperature=1.0, top_p=0.01)) > 0,
        torch.tensor([[True, False, False, False, False]]),
    )
    cold = probabilities(logits, Sampling(temperature=0.5))
    assert torch.allclose(cold, torch.softmax(logits / 0.5, -1))


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_settings_name_the_field(bad) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        Sampling(**bad)


def test_regen_with_sampled_responses(tmp_path) -> None:
    target = tiny_target()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(SEED_PROMPTS.read_text().splitlines()[:3]) + "\n")
    out = regen(
        target,
        prompts,
        tmp_path / "out.jsonl",
        8,
        4,
        progress=False,
        sampled=2,
        sampling=Sampling(temperature=1.0),
        seed=5,
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    chats = read_prompts(prompts)
    assert len(records) == 9
    for i, chat in enumerate(chats):
        group = records[3 * i : 3 * i + 3]
        assert all(r["messages"][:-1] == chat for r in group)
        greedy = target_greedy(target, encode_prompt(target.tokenizer, chat), 8, target.eos_token_ids).tokens
        assert group[0]["messages"][-1]["content"] == target.tokenizer.decode(greedy, skip_special_tokens=True)
    # Same seed, other batch size: the same file, byte for byte.
    again = regen(
        target,
        prompts,
        tmp_path / "again.jsonl",
        8,
        1,
        progress=False,
        sampled=2,
        sampling=Sampling(temperature=1.0),
        seed=5,
    )
    assert again.read_bytes() == out.read_bytes()
    with pytest.raises(ValueError, match="temperature"):
        regen(target, prompts, tmp_path / "x.jsonl", 8, 4, progress=False, sampled=1, sampling=Sampling())


def _tiny_family(family: str) -> torch.nn.Module:
    """A tiny random float64 causal LM of one family, on the tiny tokenizer's 512 ids."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    geometry = dict(
        vocab_size=512,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = (
        LlamaForCausalLM(LlamaConfig(**geometry)) if family == "llama" else Qwen3ForCausalLM(Qwen3Config(**geometry))
    )
    return model.to(torch.float64).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("temperature", [0.0, 2.0])
def test_static_cache_loop_equals_the_transformers_loop(family, temperature) -> None:
    """Same tokens from the static-cache loop and transformers' own cache, left padding and early eos included."""
    import dflash2_lightning.target.generate as gen

    hf = _tiny_family(family)
    assert gen.static_cache_supported(hf)
    target = tiny_target()
    prompts = _prompts(target, 7)
    sampling = Sampling(temperature=temperature) if temperature else Sampling()
    seeds = list(range(7))
    # eos ids taken from the rows' own outputs at different steps: rows end one by one, so finished rows ride
    # along and are dropped in groups.
    free = generate(hf, prompts, 24, [511], 0, sampling, seeds)
    eos = sorted({free[row][2 + 3 * row] for row in range(0, 7, 2)})
    static = generate(hf, prompts, 24, eos, 0, sampling, seeds, static_cache=True)
    reference = generate(hf, prompts, 24, eos, 0, sampling, seeds, static_cache=False)
    assert static == reference
    lengths = {len(t) for t in static}
    assert len(lengths) > 2 and max(lengths) == 24  # some rows stopped early, at different steps


def test_unsupported_layouts_use_the_transformers_loop() -> None:
    import dflash2_lightning.target.generate as gen

    hf = _tiny_family("qwen3")
    hf.config.use_sliding_window = True
    assert not gen.static_cache_supported(hf)
    hf.config.use_sliding_window = False
    hf.config.model_type = "gemma3"
    assert not gen.static_cache_supported(hf)
    with pytest.raises(ValueError, match="static_cache=True is not supported for model_type='gemma3'"):
        generate(hf, [[1, 2, 3]], 2, [0], 0, static_cache=True)
    assert len(generate(hf, [[1, 2, 3]], 2, [511], 0)[0]) == 2  # the transformers loop takes over


@pytest.mark.parametrize("temperature", [0.0, 2.0])
def test_continuous_batching_equals_one_batch(temperature) -> None:
    """Two cache rows for seven prompts: finished rows take the next prompts (mixed greedy and sampled rows,
    rows ending at different steps); every response is the one the reference loop gives."""
    import dflash2_lightning.target.generate as gen

    hf = _tiny_family("llama")
    target = tiny_target()
    prompts = _prompts(target, 7)
    sampling = Sampling(temperature=temperature) if temperature else Sampling()
    seeds = [None if row % 3 == 0 else row for row in range(7)]  # None: that row is greedy
    free = generate(hf, prompts, 20, [511], 0, sampling, seeds)
    eos = sorted({free[row][1 + 4 * row % 17] for row in range(0, 7, 2)})
    reference = generate(hf, prompts, 20, eos, 0, sampling, seeds, static_cache=False)
    streamed = list(gen.generate_stream(hf, prompts, 20, eos, 0, sampling, seeds, slots=2))
    assert sorted(i for i, _ in streamed) == list(range(7))
    assert dict(streamed) == dict(enumerate(reference))
    assert len({len(t) for t in reference}) > 2  # rows ended at different steps
    with pytest.raises(ValueError, match="slots=0"):
        list(gen.generate_stream(hf, prompts, 20, eos, 0, slots=0))
