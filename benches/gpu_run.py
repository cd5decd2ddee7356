"""One GPU: the default job (``asyncflow train``, the built-in arithmetic task) on a model of
Qwen2-0.5B's shape, the hf rollout engine and the trainer sharing the GPU, synchronous and
async-1, over three seeds.

    python benches/gpu_run.py [--out DIR] [--json PATH] [--steps 10] [--seeds 0 1 2]
                              [--modes sync async-1] [--transports store broadcast ipc]
    python benches/gpu_run.py --device cpu --tiny --steps 2 --seeds 0     # a smoke run, no GPU

The model: the Qwen2 architecture with the shape of Qwen/Qwen2-0.5B's config.json
(https://huggingface.co/Qwen/Qwen2-0.5B/blob/main/config.json: hidden_size 896,
intermediate_size 4864, num_hidden_layers 24, num_attention_heads 14, num_key_value_heads 2,
tie_word_embeddings true), with random weights created here from the seed (nothing is
downloaded), and the job's own ChatML tokenizer, whose vocabulary has 103 tokens where Qwen2's
has 151,936: 358.0 M parameters (357,990,400) where Qwen2-0.5B has 494.0 M (494,032,768),
all of the difference in the embedding table (tied to the output layer), so the output layer's
share of the compute is missing too; every decoder layer is Qwen2-0.5B's. The rest is the
built-in model's (``asyncflow.models.tiny``): 64 positions, RoPE base 10,000. Both counts are
printed and written. ``--tiny`` uses the built-in tiny model instead (smoke runs).

The job: ``asyncflow train``'s defaults (GRPO, 32 prompt groups of 16 responses per step, up to
8 generated tokens per response, micro-batches of 4096 tokens, packing) except:
``rollout.engine=hf``, ``rollout.device=cuda``, the trainer on the same GPU
(``trainer.engine=deepspeed`` if ``import deepspeed`` works in this Python, else ``hf`` with
``trainer.device=cuda``), ``model.dtype=bfloat16``, no warm start (random weights: every reward
is 0 and nothing is learnt; this measures speed, not learning), 64 held-out problems, no
evaluation or checkpoint before the last step, a store memory limit of 8 GiB (two versions of
the weights live in it), and ``trainer.max_steps=10``. With every reward 0 the advantages and so
the gradients are 0, but every forward, backward, optimiser step and weight publication runs as
it would otherwise. The steps were fixed at 10 before any GPU run, from an estimate of about a
minute per run (start, three model loads, evaluation, 10 steps), to keep the six runs within
about 8 minutes on an H100; nothing is tuned on the results. A 2-step smoke run of seed 0 on an
H100 then took 16 s to make the model and 43 s (sync) and 30 s (async-1) a run, steps 2 taking
4.1 s and 1.7 s: about 7 minutes for the six 10-step runs. A run is stopped after
``--run-timeout`` seconds (180), counted as failed, and the others go on.

The modes, as the pipeline suite names them: ``sync`` (``trainer.max_staleness=0``,
``trainer.streaming=false``: the trainer waits for the whole step, the rollout engine for the
new weights; they take turns on the GPU) and ``async-1`` (``max_staleness=1``, streaming: the
rollout engine generates step ``s + 1`` while the trainer trains step ``s``). ``--transports``
(default ``store``) runs each mode with each ``weights.transport`` named: ``store`` with the
trainer in the job's process, ``broadcast`` and ``ipc`` with it as one rank in a process of its
own (as the job runs them; ``ipc`` needs the GPU; such a rank trains each step once it is
whole, so ``async-1`` does not stream there). The order of the cases rotates with the seed;
each seed's model is made once and used by every case.

Per run, over steps 2 to N (the first step also pays for CUDA's and the allocator's warm-up):
- ``samples_per_s``: samples trained, per second between the ends of step 1 and step N (the
  trainer's clock, ``metrics.jsonl``);
- ``tokens_per_s``: tokens generated for those samples, per the same seconds (samples/s times
  the run's mean generated tokens per sample: under async-1 the tokens generated between two
  step ends belong to the next step's samples);
- ``generate_tokens_per_s``: all the run's generated tokens per second the rollout engine spent
  in its generation calls (``generate vK`` spans, step 1 included): the engine's own speed;
- ``publish_s`` and ``load_s`` per version, versions 2 to N: the trainer's publication of each
  step's version (``publish_seconds`` in ``metrics.jsonl``, timed where the trainer runs: export,
  then into the store, or until the job's receiver holds it) and the rollout engine's ``load
  weights vK`` spans (from the store or the receiver into the GPU's parameters, ``trace.json``);
  ``sync_s`` is their sum;
- ``peak_allocated_gib`` / ``peak_reserved_gib``: ``torch.cuda.max_memory_allocated`` and
  ``max_memory_reserved`` in the run's process (with the local launcher the rollout engine and
  held-out evaluator live in it, and the trainer too under ``store``; under ``broadcast`` and
  ``ipc`` the trainer's process is not counted here), and ``peak_used_gib``: the GPU's
  ``memory.used`` peak, sampled by ``nvidia-smi`` every 0.5 s where it is installed (every
  process, CUDA contexts too);
- ``rl_s`` and ``wall_s``: the RL phase (steps 1 to N) and the whole run.

Writes ``OUT/gpu_run.json`` (or ``--json``: the settings, the machine, every run's figures, and
the mean, smallest and largest of each over the seeds), each run's directory
``OUT/<mode>-seed<S>/`` (``summary.json``, ``metrics.jsonl``, ``trace.json``, ``run.log``; its
final model is deleted), and prints a markdown table: per mode, the mean over the seeds with the
smallest and largest beside it. A run that fails prints the end of its log and makes the script
exit non-zero; the others still run. ``--set KEY=VALUE ...`` adds overrides to every run.
"""

from __future__ import annotations

import os

# As ``asyncflow train`` does, before torch is imported; the runs inherit them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# Nothing is downloaded: the model is made here, the tokenizer is the job's own.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from asyncflow import config as cfg
from asyncflow.cli import main as asyncflow_main
from asyncflow.config import ModelConfig
from asyncflow.models.tiny import create_tiny_model, parameter_count

#: Qwen/Qwen2-0.5B's config.json (see the docstring).
QWEN2_0_5B = ModelConfig(
    hidden_size=896, intermediate_size=4864, layers=24, heads=14, kv_heads=2, max_positions=64
)
QWEN2_VOCAB = 151_936
MODES = {
    "sync": ["trainer.max_staleness=0", "trainer.streaming=false"],
    "async-1": ["trainer.max_staleness=1", "trainer.streaming=true"],
}
#: ``weights.transport``: ``store`` with the trainer in the job's process; ``broadcast`` and
#: ``ipc`` with it in a process of its own (one rank), as the job runs them.
TRANSPORTS = ("store", "broadcast", "ipc")
DASH = "\u2013"
GIB = 1 << 30
#: Lines of a failed run's log shown with its error.
TAIL = 40


def say(line: str) -> None:
    print(f"[gpu_run {time.strftime('%H:%M:%S')}] {line}", flush=True)


# -- one run, in its own process --------------------------------------------------------------


def child(run_dir: Path, overrides: list[str]) -> int:
    """Runs the job as ``asyncflow train`` does, then writes this process's GPU memory peaks."""
    code = asyncflow_main(["train", "--run-dir", str(run_dir), *overrides])
    memory: dict[str, Any] = {"cuda_initialized": torch.cuda.is_initialized()}
    if torch.cuda.is_initialized():
        devices = range(torch.cuda.device_count())
        memory |= {
            "device_name": torch.cuda.get_device_name(0),
            "max_memory_allocated": [torch.cuda.max_memory_allocated(d) for d in devices],
            "max_memory_reserved": [torch.cuda.max_memory_reserved(d) for d in devices],
        }
    (run_dir / "gpu_memory.json").write_text(json.dumps(memory, indent=1) + "\n")
    return code


class MemorySampler:
    """The GPU's ``memory.used`` peak (MiB), read by ``nvidia-smi`` every 0.5 s (None without
    nvidia-smi)."""

    def __init__(self) -> None:
        self.peak_mib: float | None = None
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> MemorySampler:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return self
        query = [smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "500"]
        self._process = subprocess.Popen(
            query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            try:  # one line per GPU: the sum is the machine's
                used = float(line.split(",")[0])
            except ValueError:
                continue
            self.peak_mib = max(self.peak_mib or 0.0, used)

    def __exit__(self, *exc: object) -> None:
        if self._process is None:
            return
        self._process.terminate()
        self._process.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=10)
        if self._process.stdout is not None:
            self._process.stdout.close()


# -- figures of a finished run ------------------------------------------------------------------


def spans_by_version(trace: dict[str, Any], prefix: str) -> dict[int, float]:
    """Seconds of the spans named ``<prefix><version>``, summed per version."""
    seconds: dict[int, float] = {}
    for event in trace["traceEvents"]:
        name = str(event.get("name", ""))
        if event.get("ph") == "X" and name.startswith(prefix):
            version = int(name.removeprefix(prefix))
            seconds[version] = seconds.get(version, 0.0) + float(event["dur"]) / 1e6
    return seconds


def gib(peaks: list[int] | None) -> float | None:
    return max(peaks) / GIB if peaks else None


def figures(run_dir: Path, config: cfg.Config, wall: float, smi_mib: float | None) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "step" in s]
    if len(steps) < 2:
        raise SystemExit(f"{run_dir}: at least 2 steps are needed (steps 2..N are measured)")
    window = steps[-1]["time"] - steps[0]["time"]
    n = config.rollout.n
    per_step = config.trainer.groups_per_step * n
    trained = sum(per_step - s["dropped_groups"] * n for s in steps[1:])
    # Tokens per sample over the run: under async-1 the rollout engine generates a step ahead,
    # so the tokens generated between two step ends belong to the next step's samples.
    tokens_per_sample = summary["tokens_generated"] / max(summary["samples_generated"], 1)
    trace = json.loads((run_dir / "trace.json").read_text())
    # Versions 2..N, those of the measured steps (the trainer in another process publishes
    # where the job's trace cannot see: each step's record carries its publication's seconds).
    publish = {s["step"]: s["publish_seconds"] for s in steps[1:] if "publish_seconds" in s}
    load = {v: t for v, t in spans_by_version(trace, "load weights v").items() if v >= 2}
    generating = sum(spans_by_version(trace, "generate v").values())
    memory = json.loads((run_dir / "gpu_memory.json").read_text())

    def mean(values: dict[int, float]) -> float | None:
        return statistics.mean(values.values()) if values else None

    publish_s, load_s = mean(publish), mean(load)
    return {
        "samples_per_s": trained / window,
        "tokens_per_s": trained * tokens_per_sample / window,
        "generate_tokens_per_s": summary["tokens_generated"] / generating if generating else None,
        "publish_s": publish_s,
        "load_s": load_s,
        "sync_s": None if publish_s is None or load_s is None else publish_s + load_s,
        "versions_published": len(publish),
        "versions_loaded": len(load),
        "peak_allocated_gib": gib(memory.get("max_memory_allocated")),
        "peak_reserved_gib": gib(memory.get("max_memory_reserved")),
        "peak_used_gib": None if smi_mib is None else smi_mib / 1024,
        "rl_s": summary["phase_seconds"]["rl"],
        "wall_s": wall,
        "measured_steps": len(steps) - 1,
        "samples_trained": trained,
        "tokens_per_sample": tokens_per_sample,
        "engines": summary["engines"],
        "device_name": memory.get("device_name"),
        "staleness_histogram": summary["staleness_histogram"],
    }


# -- the sweep --------------------------------------------------------------------------------


def deepspeed_imports() -> bool:
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import deepspeed"], capture_output=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def job_overrides(args: argparse.Namespace, trainer: str, model_dir: Path) -> list[str]:
    """The job's settings, seed and mode aside."""
    return [
        f"model.path={model_dir}",
        "model.dtype=bfloat16",
        "rollout.engine=hf",
        f"rollout.device={args.device}",
        f"trainer.engine={trainer}",
        f"trainer.device={args.device}",
        f"trainer.max_steps={args.steps}",
        "warm_start.enabled=false",
        "data.eval_size=64",
        f"run.eval_every={args.steps + 1}",
        f"run.checkpoint_every={args.steps + 1}",
        "run.progress=false",
        "run.loggers=[]",
        "store.memory_limit=8GiB",
        *args.set,
    ]


def run_one(args: argparse.Namespace, run_dir: Path, overrides: list[str]) -> dict | None:
    """One run in its own process: its figures, or None (the end of its log printed)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log = run_dir / "run.log"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", str(run_dir), *overrides]
    started = time.monotonic()
    with log.open("w") as out, MemorySampler() as smi:
        try:
            done = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, timeout=args.run_timeout
            )
            code: int | str = done.returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {args.run_timeout:.0f}s"
    wall = time.monotonic() - started
    if code != 0 or not (run_dir / "summary.json").exists():
        tail = log.read_text(errors="replace").splitlines()[-TAIL:]
        print(f"FAILED: {run_dir.name} ({code}); last lines of {log}:", *tail, sep="\n", flush=True)
        return None
    shutil.rmtree(run_dir / "final", ignore_errors=True)  # the model: a GB per run, unread
    return figures(run_dir, cfg.load(None, overrides), wall, smi.peak_mib)


def spread(values: list[float | None], digits: int) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "n/a"
    mean = statistics.mean(known)
    return f"{mean:.{digits}f} ({min(known):.{digits}f}{DASH}{max(known):.{digits}f})"


COLUMNS = [
    ("samples_per_s", "samples/s", 1),
    ("tokens_per_s", "tokens/s", 0),
    ("generate_tokens_per_s", "tokens/s in generate calls", 0),
    ("publish_s", "publish s/version", 3),
    ("load_s", "load s/version", 3),
    ("sync_s", "weight sync s/version", 3),
    ("peak_allocated_gib", "peak allocated GiB", 2),
    ("peak_reserved_gib", "peak reserved GiB", 2),
    ("peak_used_gib", "peak used GiB (nvidia-smi)", 2),
    ("rl_s", "RL s", 1),
]


def table(runs: dict[str, list[dict]]) -> str:
    rows = [
        "| mode | seeds | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "|---|---:|" + "---:|" * len(COLUMNS),
    ]
    for mode, results in runs.items():
        cells = [spread([r[key] for r in results], digits) for key, _, digits in COLUMNS]
        rows.append(f"| {mode} | {len(results)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def aggregate(runs: dict[str, list[dict]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for mode, results in runs.items():
        out[mode] = {}
        for key, _, _ in COLUMNS:
            known = [r[key] for r in results if r[key] is not None]
            if known:
                out[mode][key] = {
                    "mean": statistics.mean(known),
                    "min": min(known),
                    "max": max(known),
                }
    return out


def machine() -> dict[str, Any]:
    smi = shutil.which("nvidia-smi")
    gpus = None
    if smi is not None:
        query = [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True)
        gpus = done.stdout.strip().splitlines() if done.returncode == 0 else None
    return {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "gpus": gpus,
        "commit": git_commit(),
    }


def git_commit() -> str | None:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def label(transport: str, mode: str, args: argparse.Namespace) -> str:
    """A case's name: the mode, after the transport where several are run."""
    return f"{transport} {mode}" if len(args.transports) > 1 else mode


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        return child(Path(sys.argv[2]), sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/gpu-run"))
    parser.add_argument("--json", type=Path, default=None, help="default: OUT/gpu_run.json")
    parser.add_argument("--steps", type=int, default=10, help="trainer.max_steps of each run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument(
        "--transports", nargs="+", choices=TRANSPORTS, default=["store"], help="weights.transport"
    )
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (smoke)")
    parser.add_argument("--trainer", choices=["auto", "hf", "deepspeed"], default="auto")
    parser.add_argument("--tiny", action="store_true", help="the built-in tiny model (smoke)")
    parser.add_argument("--run-timeout", type=float, default=180.0, help="seconds per run")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="further job overrides"
    )
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: steps 2..N are measured")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_run: --device {args.device} needs CUDA, which this machine's torch "
            f"{torch.__version__} does not see (built for CUDA {torch.version.cuda or 'none'}); "
            "run on a GPU machine, or pass --device cpu --tiny for a smoke run",
            file=sys.stderr,
        )
        return 2
    trainer = args.trainer
    if trainer == "auto":
        say("checking whether deepspeed imports ...")
        trainer = "deepspeed" if deepspeed_imports() else "hf"
    shape = ModelConfig() if args.tiny else QWEN2_0_5B
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    json_path = args.json or out / "gpu_run.json"
    say(f"device {args.device}, trainer engine {trainer}, steps {args.steps}, seeds {args.seeds}")
    started = time.monotonic()
    cases = [(t, m) for t in args.transports for m in args.modes]
    runs: dict[str, list[dict]] = {label(t, m, args): [] for t, m in cases}
    record: dict[str, Any] = {"settings": {}, "machine": machine(), "runs": [], "failed": []}
    for seed in args.seeds:
        model_dir = out / f"model-seed{seed}"
        if not (model_dir / "config.json").exists():
            say(f"seed {seed}: creating the model in {model_dir} ...")
            shutil.rmtree(model_dir, ignore_errors=True)
            create_tiny_model(shape, model_dir, seed)
        params = parameter_count(model_dir)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        qwen2_params = params + (QWEN2_VOCAB - vocab) * shape.hidden_size
        overrides = [*job_overrides(args, trainer, model_dir), f"run.seed={seed}"]
        record["settings"] = {
            "overrides": job_overrides(args, trainer, out / "model-seed<seed>"),
            "modes": {m: MODES[m] for m in args.modes},
            "transports": args.transports,
            "model_parameters": params,
            "vocab_size": vocab,
            "parameters_with_qwen2_vocab": qwen2_params,
            "steps": args.steps,
            "seeds": args.seeds,
        }
        say(
            f"seed {seed}: {params / 1e6:.1f} M parameters "
            f"({qwen2_params / 1e6:.1f} M with Qwen2's vocabulary)"
        )
        order = cases[seed % len(cases) :] + cases[: seed % len(cases)]
        for transport, mode in order:
            name = label(transport, mode, args)
            run_dir = out / f"{name.replace(' ', '-')}-seed{seed}"
            say(f"seed {seed} {name}: running ({run_dir}) ...")
            case = [*MODES[mode], f"weights.transport={transport}"]
            result = run_one(args, run_dir, [*overrides, *case])
            if result is None:
                record["failed"].append({"mode": mode, "transport": transport, "seed": seed})
                continue
            runs[name].append(result)
            record["runs"].append({"mode": mode, "transport": transport, "seed": seed, **result})
            say(
                f"seed {seed} {name}: {result['samples_per_s']:.1f} samples/s, "
                f"{result['tokens_per_s']:.0f} tokens/s, weight sync "
                f"{spread([result['sync_s']], 3).split()[0]} s/version, peak allocated "
                f"{spread([result['peak_allocated_gib']], 2).split()[0]} GiB, run "
                f"{result['wall_s']:.0f}s (total {time.monotonic() - started:.0f}s)"
            )
            record["aggregate"] = aggregate(runs)
            json_path.write_text(json.dumps(record, indent=1) + "\n")
    print(table(runs), flush=True)
    say(f"wrote {json_path}; {time.monotonic() - started:.0f}s in all")
    if record["failed"]:
        print(f"{len(record['failed'])} run(s) failed; see above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
