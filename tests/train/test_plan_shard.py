"""``dflash2 plan`` with the frozen target sharded (``target.shard: fsdp``): Qwen3-235B-A22B online on 8 x 141 GB
does not fit whole, the plan says to shard it, and fits sharded, with the target's lines computed from its config."""

from __future__ import annotations

import json

from test_plan import GB, QWEN3_235B_A22B, REPO, figure, run_plan


def qwen3_moe_layer(cfg: dict) -> int:
    """Parameters of one Qwen3-MoE decoder layer, by hand: attention (with q/k norms), two norms, the router and
    every expert's gate, up and down projections."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    attention = h * q + 2 * h * kv + q * h + 2 * d
    experts = cfg["num_experts"]
    return attention + 2 * h + experts * h + experts * 3 * h * cfg["moe_intermediate_size"]


def test_qwen3_235b_a22b_online_on_8_x_141_gb_fits_with_the_target_sharded(tmp_path):
    directory = tmp_path / "qwen3-235b-a22b"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(QWEN3_235B_A22B))
    args = ["--config", str(REPO / "configs" / "qwen3_8b_online.yaml"), "--plan.device_memory", "141GB"]
    args += ["--model.init_args.target.path", str(directory)]

    code, whole, err = run_plan(*args)
    assert code == 1, whole + err
    assert "shard the frozen target over the 8 devices: --model.init_args.target.shard fsdp" in whole

    code, sharded, err = run_plan(*args, "--model.init_args.target.shard", "fsdp")
    assert code == 0, sharded + err
    assert "verdict: fits" in sharded and "frozen target " not in sharded  # no whole copy of it counted
    vocab, h, layers = (QWEN3_235B_A22B[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers"))
    parameters = 2 * vocab * h + h + layers * qwen3_moe_layer(QWEN3_235B_A22B)  # embedding, head, final norm
    assert parameters == 235_093_634_560
    assert abs(figure(sharded, "frozen target, sharded") - parameters * 2 / 8) < 0.05 * GB
    assert abs(figure(sharded, "target embedding + head, whole") - 2 * vocab * h * 2) < 0.05 * GB
    assert abs(figure(sharded, "target layers gathered") - 2 * qwen3_moe_layer(QWEN3_235B_A22B) * 2) < 0.05 * GB
    assert figure(sharded, "peak (estimate)") < 0.92 * 141 * GB < figure(whole, "peak (estimate)")


def test_the_shipped_235b_recipe_fits_one_node_of_8_x_141_gb_and_two(tmp_path):
    """configs/qwen3_235b_a22b_online.yaml as shipped (its target sharded), only the model directory given: fits 8 x
    141 GB, and over 2 nodes (16 devices) each holds half as much of the target."""
    directory = tmp_path / "Qwen3-235B-A22B"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(QWEN3_235B_A22B))
    args = ["--config", "qwen3_235b_a22b_online", "--plan.device_memory", "141GB"]
    args += ["--model.init_args.target.path", str(directory)]

    code, one_node, err = run_plan(*args)
    assert code == 0, one_node + err
    assert "8 x cuda, DDP" in one_node and "verdict: fits" in one_node
    assert "/ 8 devices (target.shard fsdp)" in one_node and "frozen target " not in one_node
    code, two_nodes, err = run_plan(*args, "--trainer.num_nodes", "2")
    assert code == 0, two_nodes + err
    assert "16 x cuda, DDP" in two_nodes and "/ 16 devices (target.shard fsdp)" in two_nodes
    name = "frozen target, sharded"
    assert abs(figure(two_nodes, name) - figure(one_node, name) / 2) < 0.05 * GB
    assert figure(two_nodes, "peak (estimate)") < figure(one_node, "peak (estimate)") < 0.92 * 141 * GB
    # HSDP: a copy of the target per node (shard_size 8), sharded within it: each device holds what one node's does
    code, per_node, err = run_plan(*args, "--trainer.num_nodes", "2", "--model.init_args.target.shard_size", "8")
    assert code == 0, per_node + err
    assert "/ 8 devices (a copy per 8 of the 16) (target.shard fsdp)" in per_node
    assert abs(figure(per_node, name) - figure(one_node, name)) < 0.05 * GB
    code, out, err = run_plan(*args, "--trainer.num_nodes", "2", "--model.init_args.target.shard_size", "6")
    assert code == 2 and "shard_size=6 does not divide the job's 16 processes" in err, out + err
