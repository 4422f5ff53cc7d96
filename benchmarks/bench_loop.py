"""The speculative loop, end to end: this project's loop (torch and onnxruntime drafters) vs the z-lab loop.

Same trained draft checkpoint, same target, same held-out prompts, greedy: every loop must produce the
target's own greedy tokens, so the benchmark asserts that all outputs are identical and then reports
wall time and time per cycle (verify + draft + bookkeeping) of each loop:

``torch``
    :func:`dflash2_lightning.decode.speculative.speculative_generate` with the torch draft (``TorchDrafter``,
    preallocated :class:`~dflash2_lightning.model.DraftCache`).
``onnxruntime``
    the same loop with :class:`~dflash2_lightning.export.onnx.OrtDrafter` on graphs exported from the same
    checkpoint (fp32; exported once into ``--onnx-dir`` or a temporary directory).
``torch-draft-vocab``
    the torch drafter drafting through the head's rows of the checkpoint's drafting vocabulary only
    (``draft_vocab.json``, :mod:`dflash2_lightning.decode.draft_vocab`): what ``dflash2 eval`` and the quickstart
    run when the file is there; same output, its own τ and cycles.
``torch-bf16-head``
    the torch drafter with the opt-in bfloat16 drafting head (:func:`low_precision_head`): the target
    still verifies with its own head, so the output is the same; its own τ and cycles are reported.
``zlab``
    ``dflash.model.dflash_generate`` of the z-lab reference (``dflash==0.1.0``) with its
    ``DFlash2DraftModel`` loaded from the same checkpoint and the target's HF model (the same modules:
    once the project loop has declared its verify rows, z-lab's verify pass multiplies packed weights too).
``cpu-stock``, ``cpu-rows_first``, ``cpu-packed``
    the torch loop (through the drafting vocabulary when the checkpoint has one, as ``dflash2 eval`` runs it)
    on a second copy of the target whose few-row linears use that fixed kernel instead of ``--cpu-linear``'s
    (:mod:`dflash2_lightning.target.cpu_linear`): what each kernel choice costs, in the same sitting.
``target``
    the target alone (:func:`target_greedy`): the row every speed-up is a ratio to.
``compare``
    with ``--compare-draft DIR``: a second draft checkpoint (a DFlash baseline beside a DFlash2 draft, say)
    in the torch loop with its own drafting vocabulary where it has one, timed round-robin with the others,
    so two drafters' speed-ups come from the same sitting.

Loops run round-robin per prompt (``--repeats`` times each), so machine noise hits all alike; the
figure per loop is the median over repeats of the summed wall time over prompts. Per-cycle cost is that
time divided by the loop's cycle count (z-lab's loop reports none: the torch loop's count is used, since
identical tokens and identical drafts give identical cycles).

    python benchmarks/bench_loop.py --draft runs/quickstart/train/hf --target smollm2 --prompts 8 --max-new-tokens 64
    python benchmarks/bench_loop.py --draft <tiny draft dir> --target tiny --threads 1
    python benchmarks/bench_loop.py --draft runs/quickstart/train/hf --compare-draft runs/dflash/train/hf \
        --loops target,torch-draft-vocab   # DFlash2 and a DFlash baseline in one sitting

Writes ``benchmarks/results/bench_loop.json`` (``--json``) with the ``uptime`` load beside the figures.
Not a test: nothing is asserted about time, only about the outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from record import load_average, loaded_label, machine, write_json

from dflash2_lightning.data.prompts import EVAL_PROMPTS, encode_prompt, read_prompts
from dflash2_lightning.decode.draft_vocab import draft_vocab_head, find_draft_vocab
from dflash2_lightning.decode.drafter import TorchDrafter, low_precision_head
from dflash2_lightning.decode.speculative import AcceptanceStats, speculative_generate, target_greedy
from dflash2_lightning.model.checkpoint import load_draft
from dflash2_lightning.target.arguments import add_target_arguments, target_spec_from_args
from dflash2_lightning.target.cpu_linear import CPU_LINEAR_CHOICES
from dflash2_lightning.target.load import load_target

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_loop.json"
CPU_LOOPS = tuple(f"cpu-{setting}" for setting in CPU_LINEAR_CHOICES if setting != "auto")
LOOPS = ("target", "torch", "onnxruntime", "zlab", "torch-draft-vocab", "torch-bf16-head", *CPU_LOOPS, "compare")
DEFAULT_LOOPS = ("target", "torch", "onnxruntime", "zlab")


def zlab_loop(draft_dir: str, target: Any) -> Callable[[list[int], int, list[int]], list[int]]:
    """``dflash_generate`` of the z-lab reference on ``target.hf``: prompt -> generated tokens."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate

    config = json.loads((Path(draft_dir) / "config.json").read_text())
    cls = DFlash2DraftModel if config["architectures"] == ["DFlash2DraftModel"] else DFlashDraftModel
    model = cls.from_pretrained(draft_dir, dtype=next(target.hf.parameters()).dtype).eval()

    def run(prompt: list[int], max_new_tokens: int, stop: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        out = dflash_generate(model, target.hf, ids, max_new_tokens, stop or None)
        return out[0, len(prompt) :].tolist()

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", required=True, help="draft checkpoint directory (config.json + model.safetensors)")
    add_target_arguments(p, default="smollm2")
    p.add_argument("--prompts", type=int, default=8, help="held-out evaluation prompts (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch (and onnxruntime) threads (default: torch's)")
    p.add_argument("--loops", default=",".join(DEFAULT_LOOPS), help=f"comma-separated subset of {','.join(LOOPS)}")
    p.add_argument(
        "--path",
        default=None,
        choices=["selector", "backbone"],
        help="decoding path of the project loop (default: selector for DFlash2; z-lab walks the selector)",
    )
    p.add_argument("--onnx-dir", default=None, help="reuse/keep the exported graphs here")
    p.add_argument("--opset", type=int, default=20)
    p.add_argument(
        "--compare-draft",
        default=None,
        help="a second draft checkpoint, timed in the same sitting as the 'compare' loop (added to --loops)",
    )
    p.add_argument("--json", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    loops = [x for x in args.loops.split(",") if x]
    if args.compare_draft and "compare" not in loops:
        loops.append("compare")
    if "compare" in loops and not args.compare_draft:
        raise SystemExit("--loops compare needs --compare-draft DIR")
    bad = [x for x in loops if x not in LOOPS]
    if bad:
        raise SystemExit(f"--loops {bad} is invalid: choose from {LOOPS}")
    if "zlab" in loops and importlib.util.find_spec("dflash") is None:
        raise SystemExit("the zlab loop needs the z-lab reference: pip install --no-deps dflash==0.1.0")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    spec = target_spec_from_args(args)
    target = load_target(spec)
    draft = load_draft(args.draft, dtype=next(target.hf.parameters()).dtype).eval()
    stop = list(target.eos_token_ids)
    prompts = [encode_prompt(target.tokenizer, m) for m in read_prompts(EVAL_PROMPTS, args.prompts)]

    # Each runner: prompt -> (tokens, SpecResult or None).
    runners: dict[str, Callable[[list[int]], tuple[list[int], Any]]] = {}
    scratch = None

    def project_loop(drafter: Any) -> Callable[[list[int]], tuple[list[int], Any]]:
        def run(prompt: list[int]) -> tuple[list[int], Any]:
            r = speculative_generate(target, drafter, prompt, args.max_new_tokens, stop)
            r.context = None
            return r.tokens, r

        return run

    if "target" in loops:
        runners["target"] = lambda prompt: (target_greedy(target, prompt, args.max_new_tokens, stop).tokens, None)
    if "torch" in loops:
        runners["torch"] = project_loop(TorchDrafter(draft, args.path))
    for name in (x for x in loops if x in CPU_LOOPS):  # the same loop on a target with a fixed kernel choice
        fixed = load_target(dataclasses.replace(spec, cpu_linear=name.removeprefix("cpu-")))
        head = draft_vocab_head(fixed, args.draft) if find_draft_vocab(args.draft) else None

        fixed_drafter = TorchDrafter(draft, args.path, head=head)

        def fixed_loop(prompt: list[int], fixed: Any = fixed, drafter: Any = fixed_drafter) -> tuple[list[int], Any]:
            r = speculative_generate(fixed, drafter, prompt, args.max_new_tokens, stop)
            r.context = None
            return r.tokens, r

        runners[name] = fixed_loop
    if "torch-draft-vocab" in loops:
        runners["torch-draft-vocab"] = project_loop(
            TorchDrafter(draft, args.path, head=draft_vocab_head(target, args.draft))
        )
    if "compare" in loops:
        other = load_draft(args.compare_draft, dtype=next(target.hf.parameters()).dtype).eval()
        other_head = draft_vocab_head(target, args.compare_draft) if find_draft_vocab(args.compare_draft) else None
        other_path = args.path if other.candidate_selector is not None else None  # a DFlash draft: its backbone
        runners["compare"] = project_loop(TorchDrafter(other, other_path, head=other_head))
    if "torch-bf16-head" in loops:
        runners["torch-bf16-head"] = project_loop(TorchDrafter(draft, args.path, head=low_precision_head(target)))
    if "onnxruntime" in loops:
        from dflash2_lightning.export.onnx import OrtDrafter
        from dflash2_lightning.export.onnx.export import export_drafter, target_embedding_and_head

        if args.onnx_dir is None:
            scratch = tempfile.TemporaryDirectory(prefix="dflash2-bench-loop-")
        directory = Path(args.onnx_dir or scratch.name)  # type: ignore[union-attr]
        if not (directory / "drafter.json").is_file():
            export_drafter(
                draft, *target_embedding_and_head(target, torch.float32), directory, opset=args.opset, with_hidden=False
            )
        ort = OrtDrafter(directory, threads=threads)
        if args.path and args.path != ort.path:
            raise SystemExit(f"--path {args.path} is not what the exported graphs decode with ({ort.path})")

        runners["onnxruntime"] = project_loop(ort)
    if "zlab" in loops:
        if args.path == "backbone" and draft.candidate_selector is not None:
            raise SystemExit("the zlab loop walks the selector of a DFlash2 draft: drop --path backbone")
        zlab = zlab_loop(args.draft, target)
        runners["zlab"] = lambda prompt: (zlab(prompt, args.max_new_tokens, stop), None)

    # Reference outputs and a warm-up of every loop (first calls pay for allocation and lazy init).
    reference = [target_greedy(target, q, args.max_new_tokens, stop).tokens for q in prompts]
    cycles, tau = {}, {}
    for name, run in runners.items():
        got = [run(q) for q in prompts]
        mismatched = [i for i, (tokens, _) in enumerate(got) if tokens != reference[i]]
        if mismatched:
            raise SystemExit(f"loop {name!r} differs from target-only greedy decoding on prompts {mismatched}")
        if got[0][1] is not None:
            stats = AcceptanceStats.from_results([r for _, r in got])
            cycles[name], tau[name] = stats.cycles, round(stats.tau, 4)
    same_drafts = next((cycles[n] for n in ("torch", "onnxruntime") if n in cycles), None)
    cycles.setdefault("zlab", same_drafts)  # type: ignore[arg-type]

    seconds: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    load_before = load_average()
    for _ in range(args.repeats):
        wall_total, cpu_total = dict.fromkeys(runners, 0.0), dict.fromkeys(runners, 0.0)
        for q in prompts:
            for name, run in runners.items():
                t0, c0 = time.perf_counter(), time.process_time()
                run(q)
                wall_total[name] += time.perf_counter() - t0
                cpu_total[name] += time.process_time() - c0
        for name in runners:
            seconds[name].append(wall_total[name])
            cpu[name].append(cpu_total[name])
    info = machine(threads, load_before)

    rows = []
    for name in runners:
        wall, used = statistics.median(seconds[name]), statistics.median(cpu[name])
        n = cycles.get(name)
        rows.append(
            dict(
                loop=name,
                seconds=round(wall, 3),
                cpu_seconds=round(used, 3),
                cycles=n,
                tau=tau.get(name),
                ms_per_cycle=round(1e3 * wall / n, 3) if n else None,
                cpu_ms_per_cycle=round(1e3 * used / n, 3) if n else None,
                runs=[round(s, 3) for s in seconds[name]],
            )
        )
    base = next((r for r in rows if r["loop"] == "torch"), None)
    alone = next((r for r in rows if r["loop"] == "target"), None)
    # Process CPU time counts every thread (onnxruntime's pool too); on a loaded machine it is the
    # steadier figure, but spinning thread pools inflate it.
    lines = [
        "| loop | τ | cycles | wall time (s) | ms per cycle | vs torch drafter | speed-up vs target | CPU time (s) "
        "| CPU vs torch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if alone:
            r["speedup"] = round(alone["seconds"] / r["seconds"], 4)
        ratio = f"{r['seconds'] / base['seconds']:.2f}x" if base else "-"
        cpu_ratio = f"{r['cpu_seconds'] / base['cpu_seconds']:.2f}x" if base else "-"
        per = f"{r['ms_per_cycle']:.2f}" if r["ms_per_cycle"] is not None else "-"
        t = "-" if r["loop"] == "target" else f"{r['tau']:.3f}" if r["tau"] is not None else "(same drafts)"
        speed = f"{r['speedup']:.2f}x" if alone else "-"
        lines.append(
            f"| {r['loop']} | {t} | {r['cycles'] or '-'} | {r['seconds']:.2f} | {per} | {ratio} | {speed} | "
            f"{r['cpu_seconds']:.2f} | {cpu_ratio} |"
        )
    generated = sum(len(t) for t in reference)
    header = (
        f"{len(prompts)} prompts x {args.max_new_tokens} tokens ({generated} generated), "
        f"target {args.target}, {threads} threads, median of {args.repeats}; load average "
        f"{load_before[0]:.2f} -> {info['load_average_after'][0]:.2f}" + loaded_label(info)
    )
    print(header)
    print("\n".join(lines))
    result = dict(
        command="python benchmarks/bench_loop.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        draft=str(args.draft),
        compare_draft=args.compare_draft,
        target=args.target,
        cpu_linear=target.cpu_linears.describe(),
        prompts=len(prompts),
        max_new_tokens=args.max_new_tokens,
        generated_tokens=generated,
        identical_outputs=True,
        rows=rows,
        machine=info,
        table="\n".join(lines),
    )
    write_json(Path(args.json), result)
    if scratch is not None:
        scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
