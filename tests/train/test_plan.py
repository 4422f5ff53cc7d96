"""`dflash2 plan`: the memory and disk a fit needs, from the config alone, checked against real runs.

Measured against the plan (stated here, asserted below):
- memory: a CPU fit of a small-but-not-trivial config (a 6-layer random Qwen3 target of hidden 256 and vocabulary
  2048, a 2-layer DFlash2 draft, 16 samples of 256 tokens, 64 anchors of block 8) runs 2 training steps in a
  subprocess, in float32 with hard CE. Two peaks are measured there: the most bytes of tensor storage alive at once
  (every storage an op returns, counted until it is freed: what the plan counts, the same on every machine) must be
  within 20% of the plan's peak (here: planned 934 MB, measured 872 MB). The peak RSS (``ru_maxrss``) minus the RSS
  just before ``fit`` is recorded beside it (the test's output and its junit property), never asserted: it adds the
  allocator's and the math libraries' own buffers, which the machine decides (the same run measured 914 MB,
  1232 MB and 1641 MB on three CPU kinds);
- disk: the offline cache a real build writes (bytes of every file) is within 20% of the planned size (it is
  exact up to the manifest, which the plan leaves out).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_helpers import run_here
from hf_families import EXPERTS, MOE, hand_count, save_tiny_hf

from dflash2_lightning import cli
from dflash2_lightning.train.plan import PlanOptions, make_plan, setup_from_config

REPO = Path(__file__).resolve().parents[2]
#: The real Qwen3-8B checkpoint's config.json values (see the design's reference): nothing else of it is needed.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
GB = 1e9
# The measured configuration: big enough that the model's memory, not Lightning's, is most of the peak.
SMALL_TARGET = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3-8b")
    (directory / "config.json").write_text(json.dumps(QWEN3_8B))
    return directory


def run_plan(*args: str) -> tuple[int, str, str]:
    """`dflash2 plan ARGS` (in this process, from the repository): (exit status, stdout, stderr)."""
    done = run_here(["plan", *args], REPO)
    return done.returncode, done.stdout, done.stderr


def figure(text: str, name: str) -> float:
    """The bytes of the plan's line ``name`` (``name  12.3 GB ...``)."""
    for line in text.splitlines():
        if line.strip().startswith(name):
            number, unit = line.strip()[len(name) :].split()[:2]
            return float(number) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}[unit]
    raise AssertionError(f"no line {name!r} in the plan:\n{text}")


def test_qwen3_8b_online_plan_per_gpu(qwen3_8b):
    config = str(REPO / "configs" / "qwen3_8b_online.yaml")
    code, out, err = run_plan(
        "--config", config, "--model.init_args.target.path", str(qwen3_8b), "--plan.device_memory", "80GB"
    )
    assert code == 0, out + err
    assert "one of 8 GPUs" in out and "disk: online mode" in out and "verdict: fits" in out
    # Qwen3-8B: 8.19 B parameters in bf16 on every GPU; the recipe's 5-layer draft ~1.17 B parameters in fp32
    # with AdamW (16 B a parameter with DDP's gradient buckets: 4 + 4 + 8 + 4).
    assert 16.2 * GB <= figure(out, "frozen target") <= 16.6 * GB
    assert 4.5 * GB <= figure(out, "draft weights") <= 4.9 * GB
    assert figure(out, "AdamW m, v") == pytest.approx(2 * figure(out, "draft weights"), rel=0.01)
    assert "chunks of 441 slots" in out  # LOGITS_CHUNK_ELEMENTS // 151936
    peak = figure(out, "peak (estimate)")
    assert 40 * GB <= peak <= 70 * GB  # the reading of this path: 55-62 GB per GPU (the plan: ~49 GB)
    # The same run on 40 GB GPUs does not fit, says so with exit 1 and says what to change.
    code, small, _ = run_plan(
        "--config", config, "--model.init_args.target.path", str(qwen3_8b), "--plan.device_memory", "40GB"
    )
    assert code == 1 and "verdict: does not fit" in small
    # The advice names the project's FSDP strategy as a class config (Lightning's own `fsdp` refuses the recipe's
    # norm clipping, and a plain class name is not a strategy Lightning takes).
    assert "num_anchors 128" in small
    assert """--trainer.strategy '{"class_path": "dflash2_lightning.train.fsdp.DraftFSDPStrategy"}'""" in small
    # Mixed precision: autocast's bf16 copy of every draft weight lives through the step.
    assert figure(out, "draft weights, autocast copies") == pytest.approx(figure(out, "draft weights") / 2, rel=0.03)
    # FSDP divides the draft's states by 8; the frozen target stays whole on every GPU. DraftFSDPStrategy gathers
    # float32 weights (its mixed precision keeps float32 master weights), Lightning's own fsdp bf16 ones.
    code, fsdp, _ = run_plan(
        "--config",
        config,
        "--model.init_args.target.path",
        str(qwen3_8b),
        "--plan.device_memory",
        "40GB",
        "--trainer.strategy",
        '{"class_path": "dflash2_lightning.train.fsdp.DraftFSDPStrategy"}',
    )
    assert figure(fsdp, "draft weights") == pytest.approx(figure(out, "draft weights") / 8, rel=0.01)
    assert figure(fsdp, "frozen target") == figure(out, "frozen target")
    # DDP's 4 x 4.7 GB of draft states (weights, gradients, the bucket copy, AdamW's two) become an eighth (without a
    # bucket copy), less two float32 layers gathered.
    assert code == 0 and figure(fsdp, "peak (estimate)") < peak - 12 * GB
    code, lightning_fsdp, _ = run_plan(
        "--config",
        config,
        "--model.init_args.target.path",
        str(qwen3_8b),
        "--plan.device_memory",
        "40GB",
        "--trainer.strategy",
        "fsdp",
    )
    assert figure(fsdp, "FSDP gathered unit") == pytest.approx(
        2 * figure(lightning_fsdp, "FSDP gathered unit"), rel=0.02
    )


def test_qwen3_8b_offline_cache_per_sample(qwen3_8b, tmp_path):
    code, out, err = run_plan(
        "--config",
        str(REPO / "configs" / "qwen3_8b_offline.yaml"),
        "--model.init_args.target.path",
        str(qwen3_8b),
        "--plan.device_memory",
        "80GB",
        "--data.init_args.offline.cache_dir",
        str(tmp_path / "cache"),
    )
    assert code == 0, out + err
    # 5 layers x 4096 float16 features (40,960 B) + int32 greedy token + int32 id + 2 bool masks, 3072 tokens
    per_sample = 3072 * (5 * 4096 * 2 + 4 + 4 + 2)
    assert f"({per_sample / 1e6:.1f} MB a sample" in out
    assert "per 1000 samples" in out and "not checked" in out  # data/train.jsonl is not here: size unknown
    fit, build = out.split("building the offline cache, per device")
    assert "target embedding + head" in fit and "frozen target" not in fit
    assert figure(fit, "target embedding + head") == pytest.approx(2 * 151936 * 4096 * 2, rel=0.01)
    # The cache build, a phase of its own: the whole target on every device and its forward over
    # cache_batch_size (4) samples with the logits (4 x 3072 x 151936 bf16 values)
    assert figure(build, "frozen target") == pytest.approx(8.19e9 * 2, rel=0.01)
    assert figure(build, "target forward (no_grad)") > 4 * 3072 * 151936 * 2
    assert "fits" in build.splitlines()[4] and "verdict: fits" in out


def test_the_plan_names_the_cache_build_when_it_alone_does_not_fit(qwen3_8b, tmp_path):
    """On a 40 GB device the offline fit (32.9 GB) fits but the cache build, 16 samples a forward, does not."""
    code, out, err = run_plan(
        "--config",
        str(REPO / "configs" / "qwen3_8b_offline.yaml"),
        "--model.init_args.target.path",
        str(qwen3_8b),
        "--plan.device_memory",
        "40GB",
        "--data.init_args.offline.cache_batch_size",
        "16",
        "--data.init_args.offline.cache_dir",
        str(tmp_path / "cache"),
    )
    fit, build = out.split("building the offline cache, per device")
    assert "device memory 40.0 GB: fits" in fit and "device memory 40.0 GB: DOES NOT FIT" in build
    assert "verdict: does not fit" in out
    assert "--data.init_args.offline.cache_batch_size 8" in out
    assert "--data.init_args.batch_size" not in out  # the fit's own batch is not what needs changing


def test_plan_refuses_bad_input_in_one_line(qwen3_8b):
    code, out, err = run_plan(
        "--config",
        str(REPO / "configs" / "qwen3_8b_online.yaml"),
        "--model.init_args.target.path",
        str(qwen3_8b),
        "--plan.device_memory",
        "lots",
    )
    assert code == 2 and err.strip().count("\n") == 0
    assert err.startswith("dflash2: error: plan.device_memory='lots' is invalid")


def small_config(
    tmp_path: Path, mode: str = "online", steps: int = 2, precision: str = "32", token_loss: str = "ce"
) -> Path:
    """A CPU fit of SMALL_TARGET, no validation, no logger, no checkpoint (only the training steps' memory)."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "precision": precision,
            "max_steps": steps,
            "logger": False,
            "enable_checkpointing": False,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(tmp_path / "runs"),
        },
        "model": {
            "class_path": "dflash2_lightning.train.DFlash2Module",
            "init_args": {
                "target": {"tiny": SMALL_TARGET, "seed": 0, "cpu_linear": "stock"},
                "draft": {"num_hidden_layers": 2, "block_size": 8, "selector_rank": 32, "selector_top_k": 8},
                "objective": {"token_loss": token_loss, "num_anchors": 64},
                "validation": {"temperature": None},
            },
        },
        "data": {
            "class_path": "dflash2_lightning.data.DraftDataModule",
            "init_args": {
                "seq_len": 256,
                "batch_size": 16,
                "val_fraction": 0.0,
                "mode": mode,
                "max_samples": 64,
                "offline": {"cache_dir": str(tmp_path / "cache")},
            },
        },
    }
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


MEASURE = """
import resource, sys
sys.path.insert(0, sys.argv[2])  # tests/
import torch
from memory_helpers import LiveTensorBytes
from dflash2_lightning import cli
from dflash2_lightning.target.tiny import tiny_tokenizer
# Before the baseline, what the plan does not count: the libraries' code (Lightning, the transformers model,
# autograd's first backward) and the tiny target's tokenizer.
import lightning.pytorch, transformers.models.qwen3.modeling_qwen3
from dflash2_lightning.train import lightning_cli, module
tiny_tokenizer(2048)
x = torch.ones(64, 64, requires_grad=True)
(x @ x).sum().backward()


def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
before = rss()
with LiveTensorBytes() as tensors:
    status = cli.main(["fit", "--config", sys.argv[1]])
rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("MEASURED", tensors.peak, rss_peak - before, status or 0)
"""


# bf16-mixed is not measured: on a CPU its peak says more about oneDNN's bf16 buffers than about the plan (RSS 776 MB
# in one run, 1129 MB in CI's full suite, planned 856 MB); the GPU check is where the mixed-precision terms are to be
# compared.
def test_plan_within_20_percent_of_a_measured_cpu_fit(tmp_path, record_property):
    config = small_config(tmp_path)
    code, out, err = run_plan("--config", str(config))
    assert code == 0, out + err
    planned = figure(out, "peak (estimate)")
    # glibc's malloc raises its mmap threshold after each large free, and then keeps freed blocks up to 32 MB in the
    # heap (RSS that no tensor uses); a fixed threshold returns them, so RSS follows the live tensors more closely.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(config), str(REPO / "tests")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env=env,
    )
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("MEASURED")]
    assert line, run.stdout + run.stderr
    tensor_peak, rss_delta, status = map(int, line[0].split()[1:])
    print(
        f"CPU fit (float32, ce): planned peak {planned / 1e6:.1f} MB, measured tensor peak {tensor_peak / 1e6:.1f} "
        f"MB, peak RSS delta {rss_delta / 1e6:.1f} MB"
    )
    record_property("planned_peak_bytes", planned)
    record_property("tensor_peak_bytes", tensor_peak)
    record_property("rss_peak_delta_bytes", rss_delta)  # recorded only: the machine's allocator decides it
    assert status == 0
    assert abs(planned - tensor_peak) <= 0.2 * tensor_peak, (planned, tensor_peak, out)


def test_plan_within_20_percent_of_a_built_offline_cache(tmp_path, argv_plain):
    config = small_config(tmp_path, mode="offline", steps=1)
    code, out, err = run_plan("--config", str(config))
    assert code == 0, out + err
    planned = figure(out, "disk: offline feature cache")
    assert "fits" in out.split("disk:")[1]
    assert cli.main(["fit", "--config", str(config)]) in (0, None)
    built = sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*") if f.is_file())
    print(f"offline cache: planned {planned / 1e6:.2f} MB, built {built / 1e6:.2f} MB")
    assert abs(planned - built) <= 0.2 * built


@pytest.fixture
def argv_plain(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["dflash2"])


def test_fit_refuses_a_run_that_clearly_does_not_fit_before_loading_the_target(tmp_path, argv_plain, capsys):
    from dflash2_lightning.target.load import _TARGETS, clear_target_cache

    clear_target_cache()  # what earlier tests of this process loaded
    config = small_config(tmp_path)
    args = ["fit", "--config", str(config), "--plan.device_memory", "10MB"]
    assert cli.main(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash2")]
    assert len(errors) == 1 and errors[0].startswith("dflash2: error: this run does not fit: needs ~")
    err = errors[0]
    assert "--plan.check false" in err
    assert not (tmp_path / "runs").exists()  # nothing started
    assert not any('"hidden_size": 256' in key for key in _TARGETS)  # the target was never loaded


@pytest.mark.parametrize("devices, local_rank, expected", [(8, None, 0), (8, "3", 3), ("[4, 5]", "1", 5)])
def test_each_rank_asks_its_own_gpu_for_free_memory(monkeypatch, devices, local_rank, expected):
    """fit runs the plan in every rank before Lightning sets the rank's device: asking the current device would open
    a CUDA context on GPU 0 from every rank (seven stray contexts under 8-GPU DDP)."""
    import torch

    from dflash2_lightning.train.plan_command import plan_of

    asked: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: asked.append(device) or (70 * 2**30, 80 * 2**30)
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: asked.append(device) or "GPU")
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    plan = plan_of(
        [
            "--config",
            str(REPO / "configs" / "tiny.yaml"),
            "--trainer.accelerator",
            "gpu",
            "--trainer.devices",
            str(devices),
        ]
    )
    assert asked == [expected, expected]  # free memory and name, both of the rank's own device, never the current one
    assert f"cuda:{expected}" in plan.device and plan.capacity == 70 * 2**30


# ----------------------------------------------------------------------------- bad input: fit's one-line errors
TINY = REPO / "configs" / "tiny.yaml"


def plan_error(capsys, *args: str) -> str:
    """`dflash2 plan ARGS` in-process: exit 2 and exactly one `dflash2: error:` line on stderr (returned)."""
    assert cli.main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash2: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "args, needles",
    [
        (
            ["--config", str(TINY), "--trainer.max_stepz", "3"],
            [
                "--trainer.max_stepz is not a setting (on the command line); did you mean --trainer.max_steps?",
                "`dflash2 plan --help` lists every setting",
            ],
        ),
        (["--config", str(TINY), "--bogus", "1"], ["--bogus is not a setting (on the command line);"]),
        (["--config", str(TINY), "--trainer.max_steps"], ["--trainer.max_steps needs a value"]),
        (["--config", "missing.yaml"], ["config file", "missing.yaml' does not exist: check the --config path"]),
        ([], ["data, model not given (no config?)", "`dflash2 plan --config CONFIG.yaml`"]),
        (
            ["--config", str(TINY), "--plan.device_memory", "0"],
            ["plan.device_memory='0' is invalid: must be a positive, finite size"],
        ),
        (["--config", str(TINY), "--plan.device_memory", "1e400"], ["plan.device_memory='1e400' is invalid"]),
    ],
    ids=["typo", "unknown", "no-value", "missing-config", "no-config", "memory-0", "memory-1e400"],
)
def test_plan_maps_command_line_mistakes_as_fit_does(argv_plain, capsys, args, needles):
    err = plan_error(capsys, *args)
    assert all(needle in err for needle in needles), err


CONFIG_FILES = {
    "binary": (b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)), ["is not a text file (byte 8 is not UTF-8)"]),
    "yaml-syntax": (
        b"trainer:\n  max_steps: [\n",
        ["is not valid YAML: expected the node content", "at line 3, column 1", "fix that line"],
    ),
    "empty": (b"", ["is empty (no settings)"]),
    "comments-only": (b"# nothing here\n", ["is empty (no settings)"]),
    "a-list": (b"- trainer\n- model\n", ["holds a YAML list, not a mapping of settings"]),
    "typo": (
        TINY.read_bytes().replace(b"max_steps:", b"max_stepz:"),
        ["trainer.max_stepz is not a setting (in config", "did you mean trainer.max_steps?"],
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIG_FILES))
def test_a_config_file_that_is_no_yaml_mapping_is_named(tmp_path, argv_plain, capsys, name):
    """Binary, broken YAML, empty, a list: one line naming the file (never `<unicode string>`), in plan and fit."""
    content, needles = CONFIG_FILES[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(content)
    for action in ("plan", "fit"):
        assert cli.main([action, "--config", str(path)]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("dflash2")]
        assert len(lines) == 1 and lines[0].startswith("dflash2: error: ") and "Traceback" not in err, err
        assert str(path) in lines[0] and "<unicode string>" not in err, err
        assert all(needle in lines[0] for needle in needles), err
    assert not (tmp_path / "runs").exists()


def _with_config(directory: Path, config: str) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(config)
    return directory


TARGET_CONFIGS = {
    "vision": (
        json.dumps(
            {
                "model_type": "vit",
                "hidden_size": 768,
                "num_hidden_layers": 12,
                "num_attention_heads": 12,
                "image_size": 224,
            }
        ),
        ["model_type 'vit' is not a causal language model", "a draft needs a decoder-only target"],
    ),
    "truncated": (json.dumps(QWEN3_8B)[:120], ["is not valid JSON (", "truncated? copy the model's config.json"]),
    "empty": ("", ["config.json is empty"]),
    "array": ("[1, 2]", ["holds a JSON list, not an object of settings"]),
    "negative": (json.dumps({**QWEN3_8B, "hidden_size": -4096}), ["hidden_size=-4096 is invalid: must be from 1 to"]),
    "string": (json.dumps({**QWEN3_8B, "hidden_size": "big"}), ["hidden_size='big' is invalid: must be an integer"]),
    "deep": (
        json.dumps({**QWEN3_8B, "num_hidden_layers": 100_000_000}),
        ["num_hidden_layers=100000000 is invalid: must be from 1 to 1024", "largest published decoder models"],
    ),
    "unknown-type": (json.dumps({**QWEN3_8B, "model_type": "qwen99"}), ["model_type 'qwen99' is not known"]),
    "no-hidden-size": (json.dumps({k: v for k, v in QWEN3_8B.items() if k != "hidden_size"}), ["has no hidden_size"]),
}


@pytest.fixture
def nothing_built(monkeypatch):
    """Building the target (on the meta device or with weights) fails the test: the checks come before it."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the target was built before its config.json was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize("name", sorted(TARGET_CONFIGS))
def test_a_bad_target_config_json_is_refused_before_anything_is_built(
    tmp_path, argv_plain, capsys, nothing_built, name
):
    content, needles = TARGET_CONFIGS[name]
    target = _with_config(tmp_path / "target", content)
    err = plan_error(capsys, "--config", str(TINY), "--model.init_args.target.path", str(target))
    assert str(target / "config.json") in err and all(needle in err for needle in needles), err
    # fit without its plan check loads the target itself: the same check, before any weight is read
    assert (
        cli.main(
            [
                "fit",
                "--config",
                str(TINY),
                "--model.init_args.target.path",
                str(target),
                "--plan.check",
                "false",
                "--trainer.logger",
                "false",
            ]
        )
        == 2
    )
    fit_err = capsys.readouterr().err
    assert all(needle in fit_err for needle in needles), fit_err


def test_the_qwen3_recipe_on_another_vocabulary_names_the_mask_setting_and_the_fix(tmp_path, argv_plain, capsys):
    llama3 = {
        **QWEN3_8B,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }
    target = _with_config(tmp_path / "llama3", json.dumps(llama3))
    err = plan_error(
        capsys, "--config", str(REPO / "configs" / "qwen3_8b_online.yaml"), "--model.init_args.target.path", str(target)
    )
    assert err.startswith(
        "dflash2: error: --model.init_args.draft.mask_token_id=151669 is invalid: must satisfy "
        "0 <= mask_token_id < vocab_size=128256; the Qwen3 recipes reserve that id"
    ), err
    assert "delete mask_token_id from the config's draft settings" in err
    code = cli.main(
        [
            "plan",
            "--config",
            str(REPO / "configs" / "qwen3_8b_online.yaml"),
            "--model.init_args.target.path",
            str(target),
            "--model.init_args.draft",
            '{"mask_token_id": null}',
            "--plan.device_memory",
            "80GB",
        ]
    )
    assert code in (0, 1), capsys.readouterr().err  # the fix given works: a plan, fitting or not


# ----------------------------------------------------------------------------- mixture-of-experts targets
#: Qwen3-235B-A22B's config.json values (the fields the plan reads); its model card: 235B parameters, 22B active.
QWEN3_235B_A22B = {
    **QWEN3_8B,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "moe_intermediate_size": 1536,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}


def moe_config(tmp_path: Path, directory: Path) -> dict:
    """small_config's fit with ``directory`` as the target."""
    config = yaml.safe_load(small_config(tmp_path).read_text())
    config["model"]["init_args"]["target"] = {"path": str(directory)}
    return config


@pytest.mark.parametrize("family", MOE)
def test_plan_counts_all_experts_for_memory_and_the_active_ones_for_flops(tmp_path, family):
    from transformers import AutoModelForCausalLM

    directory = save_tiny_hf(family, tmp_path / family)
    built = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)  # what the fit loads
    total, active = hand_count(family)
    config = moe_config(tmp_path, directory)
    run = setup_from_config(config)
    assert run.target.parameters == sum(p.numel() for p in built.parameters()) == total
    assert run.target.active_parameters == active
    # The plan's draft has the geometry the fit derives from the loaded target (Target.draft_config).
    from dflash2_lightning.target.load import load_target
    from dflash2_lightning.target.spec import TargetSpec

    fitted = load_target(TargetSpec(path=str(directory))).draft_config(num_hidden_layers=2, block_size=8)
    for name in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert getattr(run.draft, name) == getattr(fitted, name), name
    assert run.draft.intermediate_size == fitted.intermediate_size and run.draft.rope_theta == fitted.rope_theta
    assert list(run.draft.target_layer_ids) == list(fitted.target_layer_ids)
    plan = make_plan(config, PlanOptions(device_memory="80GB"))
    frozen = next(item for item in plan.memory if item.name == "frozen target")
    assert frozen.bytes == total * 4  # float32: every expert's weights
    experts, k = EXPERTS[family]
    assert f"all {experts} experts" in frozen.note and f"{k} a token" in frozen.note
    # FLOPs: the active parameters but the embedding (a lookup) and the head over every token; with hard CE the head
    # runs over the rows the blocks read only (anchors x block, at most every token).
    tokens, vh = run.batch_size * run.seq_len, 512 * 64
    anchors = min(run.objective.num_anchors, run.seq_len - run.draft.block_size + 1)
    rows = min(tokens, run.batch_size * anchors * run.draft.block_size)
    assert plan.target_flops == 2 * ((active - 2 * vh) * tokens + vh * rows)
    assert "compute: target forward" in plan.render()


def test_plan_of_qwen3_235b_a22b_counts_235b_parameters_and_22b_active(tmp_path):
    directory = tmp_path / "qwen3-235b-a22b"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(QWEN3_235B_A22B))
    code, out, err = run_plan(
        "--config",
        str(REPO / "configs" / "qwen3_8b_online.yaml"),
        "--model.init_args.target.path",
        str(directory),
        "--plan.device_memory",
        "141GB",
    )
    assert code == 1, out + err  # the whole target on every GPU: it does not fit
    assert "target 235.09 B parameters (all 128 experts; 22.19 B active: 8 a token)" in out
    assert 470.0 * GB <= figure(out, "frozen target") <= 470.4 * GB
    # 2 x (22.19 B - embedding and head 2 x 0.62 B) x 3072 tokens + the head over 3072 rows
    assert "compute: target forward 132.52 TFLOP a step" in out
