"""``asyncflow reliability``: runs every fault many times, the soak against one daemon and a
cluster, tallies the fuzzer's log and the random-input tests, and writes ``docs/reliability.md``.
Separate from the fast CI tests, which run each fault once."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncflow.reliability import faults, hardening
from asyncflow.reliability.deployment import Kind
from asyncflow.reliability.soak import SoakResult, soak


@dataclass
class Row:
    """One line of the fault table: a fault, how often it was tried, what came of it."""

    fault: str
    trials: int = 0
    rows: int = 0
    lost: int = 0
    duplicated: int = 0
    partial: int = 0
    crashes: int = 0
    expected: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def add(self, o: faults.Outcome) -> None:
        self.trials += 1
        self.rows += o.rows
        self.lost += o.lost
        self.duplicated += o.duplicated
        self.partial += o.partial
        self.crashes += o.crashes
        self.expected.update(o.expected_errors)
        self.notes.extend(n for n in o.notes if "unclear" in n or "hung" in n)

    def markdown(self) -> str:
        expected = ", ".join(f"{k}: {v}" for k, v in sorted(self.expected.items())) or "none"
        verdict = "ok" if not (self.lost or self.duplicated or self.partial or self.crashes or
                               self.notes) else "FAILED"  # fmt: skip
        return (
            f"| {self.fault} | {self.trials} | {self.rows} | {self.lost} | {self.duplicated} "
            f"| {self.partial} | {self.crashes} | {expected} | {verdict} |"
        )


def progress(message: str) -> None:
    print(f"[reliability {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


#: What the three ``--fsync`` rows inject: the daemon's process dies, the machine does not.
PROCESS_DEATH = "process death, page cache kept"


def faults_table(trials: int) -> list[Row]:
    plans: list[tuple[str, Callable[[int], faults.Outcome]]] = [
        ((f"SIGKILL consumer holding leases (standalone), leases {faults.LEASE:g} s, "
          f"--reconnect-grace {faults.GRACE:g} s"),
         lambda s: faults.consumer_killed_holding_leases("standalone")),
        ((f"SIGKILL consumer holding leases (cluster), leases {faults.LEASE:g} s, "
          f"--reconnect-grace {faults.GRACE:g} s"),
         lambda s: faults.consumer_killed_holding_leases("cluster")),
        ("SIGKILL producer mid-put (standalone, shm)",
         lambda s: faults.producer_killed_mid_put("standalone", "shm", s)),
        ("SIGKILL producer mid-put (standalone, tcp)",
         lambda s: faults.producer_killed_mid_put("standalone", "tcp", s)),
        ("SIGKILL producer mid-put (cluster)",
         lambda s: faults.producer_killed_mid_put("cluster", "tcp", s)),
        (f"SIGKILL standalone daemon under load ({PROCESS_DEATH}), restart, --fsync always",
         lambda s: faults.daemon_killed("standalone", None, "always", s)),
        (f"SIGKILL standalone daemon under load ({PROCESS_DEATH}), restart, --fsync 20ms",
         lambda s: faults.daemon_killed("standalone", None, "20ms", s)),
        (f"SIGKILL standalone daemon under load ({PROCESS_DEATH}), restart, --fsync never",
         lambda s: faults.daemon_killed("standalone", None, "never", s)),
        ("SIGKILL controller under load, restart",
         lambda s: faults.daemon_killed("cluster", "controller", "always", s)),
        ("SIGKILL storage daemon under load, restart",
         lambda s: faults.daemon_killed("cluster", f"storage-{s % 3}", "always", s)),
        ("daemon killed for good: client call", lambda s: faults.daemon_stays_down(2.0)),
        ("daemon frozen (SIGSTOP): waiting claim", lambda s: faults.daemon_frozen(2.0)),
        ("garbage and mutated frames to a live daemon",
         lambda s: faults.garbage_frames(rounds=50, seed=s)),
        ("damaged log: a byte of the meta log flipped after a clean stop; start, then --recover",
         hardening.damaged_log),
        ("in-place write through a shared-memory view of another reader's row",
         lambda s: hardening.read_only_views()),
        (("socket-path clashes: a live daemon's path, a regular file, a path that leads to "
          "another daemon"), lambda s: hardening.socket_path_clash()),
        ("slot exhaustion: 40 silent sockets, then every place taken by idle clients",
         lambda s: hardening.slot_exhaustion()),
    ]  # fmt: skip
    rows = []
    for name, plan in plans:
        row = Row(name)
        for seed in range(trials):
            progress(f"{name}: trial {seed + 1}/{trials}")
            try:
                row.add(plan(seed))
            except Exception as e:  # a harness failure is a finding too
                row.trials += 1
                row.crashes += 1
                row.notes.append(f"unclear: trial {seed} raised {type(e).__name__}: {e}")
        rows.append(row)
    return rows


def floods_table(trials: int) -> list[hardening.Flood]:
    """Each memory flood ``trials`` times, keeping the highest peak."""
    plans: list[tuple[str, Callable[[], hardening.Flood]]] = [
        ("stalled puts of 1 GiB", lambda: hardening.stalled_puts(1 << 30, 300 << 20)),
        ("stalled puts of 200 MiB", lambda: hardening.stalled_puts(200 << 20, 190 << 20)),
        ("unread claims", lambda: hardening.unread_claims(2_000_000)),
    ]
    floods = []
    for name, plan in plans:
        got = []
        for k in range(trials):
            progress(f"memory flood, {name}: trial {k + 1}/{trials}")
            try:
                got.append(plan())
            except Exception as e:  # a harness failure is a finding too
                got.append(hardening.Flood(f"{name}: trial {k} raised {type(e).__name__}: {e}"))
        failed = [f for f in got if not f.ok]
        worst = failed[0] if failed else max(got, key=lambda f: f.peak_rss - f.start_rss)
        worst.trials = len(got)
        floods.append(worst)
    return floods


def flood_lines(floods: list[hardening.Flood]) -> list[str]:
    lines = [
        (
            "| flood | trials | sent | --memory-limit + --max-transit-bytes (MiB) "
            "| RSS at start (MiB) | peak RSS, most of any trial (MiB) | peak - start (MiB) "
            "| outcome |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines.extend(
        f"| {f.flood} | {f.trials} | {f.sent} {f.unit} | {f.limit / 2**20:.0f} + "
        f"{f.transit / 2**20:.0f} | {f.start_rss / 2**20:.0f} | {f.peak_rss / 2**20:.0f} "
        f"| {(f.peak_rss - f.start_rss) / 2**20:.0f} | {'ok' if f.ok else 'FAILED'} |"
        for f in floods
    )
    return lines


def fuzz_figures(log: Path | None, artifacts: Path) -> tuple[int, float, int]:
    """(executions, seconds, crash inputs) of the fuzz run whose output is in ``log``."""
    if log is None or not log.exists():
        return 0, 0.0, 0
    text = log.read_text(errors="replace")
    done = re.findall(r"Done (\d+) runs in (\d+) second", text)
    crashes = len(list(artifacts.glob("crash-*"))) if artifacts.exists() else 0
    crashes += text.count("==ERROR: libFuzzer") + text.count("panicked at")
    if not done:
        return 0, 0.0, crashes
    runs, seconds = done[-1]
    return int(runs), float(seconds), crashes


CORPUS = Path("crates/asyncflow-proto/fuzz/corpus/decode_frame")
#: The test that replays every file of the corpus through the decoder.
REPLAY = ["cargo", "test", "--locked", "-p", "asyncflow-proto", "--test", "untrusted_input",
          "--", "--exact", "every_corpus_input_decodes_without_panicking"]  # fmt: skip


def corpus_replay() -> dict[str, Any]:
    """Replays the fuzz corpus with ``cargo test``: how many inputs the corpus holds (and how
    many of them are checked in), and whether the test passed, from cargo's own summary."""
    inputs = sum(1 for _ in CORPUS.iterdir())
    tracked = subprocess.run(
        ["git", "ls-files", "--", str(CORPUS)], capture_output=True, text=True, check=False
    ).stdout.split()
    done = subprocess.run(REPLAY, capture_output=True, text=True, check=False)
    results = re.findall(r"test result: \w+\. \d+ passed; \d+ failed[^\n]*", done.stdout)
    summary = results[-1] if results else (done.stderr.strip().splitlines() or ["no output"])[-1]
    passed = done.returncode == 0 and summary.startswith("test result: ok. 1 passed; 0 failed")
    return {
        "inputs": inputs,
        "checked_in": len(tracked),
        "outcome": "passed" if passed else "failed",
        "summary": summary,
        "command": " ".join(REPLAY),
    }


def checkout() -> dict[str, Any]:
    """The commit the run starts at, the date, and tracked files changed but not committed
    (the checkout is shared: the daemon built from it may hold them)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False).stdout

    return {
        "commit": git("rev-parse", "--short=12", "HEAD").strip() or "unknown",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "uncommitted": [line[3:] for line in git("status", "--porcelain", "-uno").splitlines()],
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def random_input_tests(examples: int) -> tuple[str, int, list[str]]:
    """Runs the hypothesis tests with ``examples`` examples each; returns pytest's summary, its
    exit code, and its one-line reasons for each failure or error."""
    env = os.environ | {"AF_HYPOTHESIS_EXAMPLES": str(examples)}
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "tests/store/test_store_hypothesis.py"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    out = done.stdout.strip().splitlines()
    summary = out[-1] if out else done.stderr[-500:]
    reasons = [line[:300] for line in out if line.startswith(("FAILED ", "ERROR "))]
    return summary, done.returncode, reasons


def soak_lines(results: list[SoakResult]) -> list[str]:
    lines = [
        (
            "| deployment | clients | seconds | rows | lost | duplicated | partial | errors "
            "| calls/s | p50 put/claim/ack (ms) | p99 put/claim/ack (ms) | peak RSS / limit (MiB) |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in results:
        p50 = " / ".join(f"{r.p50_ms.get(op, 0):.2f}" for op in ("put", "claim", "ack"))
        p99 = " / ".join(f"{r.p99_ms.get(op, 0):.2f}" for op in ("put", "claim", "ack"))
        rss = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(r.peak_rss.items()))
        lines.append(
            f"| {r.kind} | {r.clients} | {r.seconds:.0f} | {r.rows} | {r.lost} | {r.duplicated} "
            f"| {r.partial} | {len(r.errors)} | {r.ops_per_s:.0f} | {p50} | {p99} "
            f"| {rss} (limit {r.memory_limit / 2**20:.0f} each) |"
        )
    return lines


def soak_errors(results: list[SoakResult], most: int = 5) -> list[str]:
    """The errors the soak's clients got, the commonest first, each with its count."""
    lines = []
    for r in results:
        if r.errors:
            common = Counter(r.errors).most_common(most)
            lines.append(f"Errors of the {r.kind} soak ({len(r.errors)}, the commonest first):")
            lines += [f"- {n}x `{e[:240]}`" for e, n in common]
            lines.append("")
    return lines


def load_average() -> str:
    """The 1, 5 and 15 minute load averages."""
    try:
        return " / ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def run(
    out: Path,
    trials: int = 20,
    soak_seconds: float = 60.0,
    fuzz_log: Path | None = None,
    examples: int = 500,
    render_only: bool = False,
) -> int:
    """Runs everything (results kept in ``bench-out/reliability.json``), then writes the
    report; with ``render_only``, writes it from the kept results and the fuzz log alone."""
    results = Path("bench-out/reliability.json")
    if not render_only:
        started = time.monotonic()
        load_before = load_average()
        run_at = checkout()
        rows = faults_table(trials)
        floods = floods_table(trials)
        kinds: tuple[Kind, ...] = ("standalone", "cluster")
        soaks = []
        for kind in kinds:
            progress(f"soak: 64 clients against {kind} for {soak_seconds:.0f}s")
            soaks.append(soak(kind, soak_seconds))
        progress(f"random-input tests, {examples} examples each")
        summary, code, reasons = random_input_tests(examples)
        progress("fuzz corpus replayed by cargo test")
        replay = corpus_replay()
        kept = {
            "faults": [vars(r) | {"expected": dict(r.expected)} for r in rows],
            "floods": [asdict(f) for f in floods],
            "soaks": [asdict(s) for s in soaks],
            "random_input": {
                "summary": summary,
                "code": code,
                "examples": examples,
                "reasons": reasons,
            },
            "corpus_replay": replay,
            "run": run_at | {"trials": trials, "soak_seconds": soak_seconds},
            "machine": {
                "cpu": cpu_model(),
                "load_before": load_before,
                "load_after": load_average(),
                "minutes": (time.monotonic() - started) / 60,
            },
        }
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(kept, indent=1) + "\n")
    kept = json.loads(results.read_text())
    rows = [Row(**(r | {"expected": Counter(r["expected"])})) for r in kept["faults"]]
    soaks = [SoakResult(**s) for s in kept["soaks"]]
    text, failed = render(rows, soaks, kept, fuzz_log)
    out.write_text(text)
    progress(f"wrote {out}")
    return 1 if failed else 0


def render(
    rows: list[Row], soaks: list[SoakResult], kept: dict[str, Any], fuzz_log: Path | None
) -> tuple[str, bool]:
    """The report's markdown, and whether anything in it failed."""
    runs, seconds, crashes = fuzz_figures(
        fuzz_log, Path("crates/asyncflow-proto/fuzz/artifacts/decode_frame")
    )
    random_input, machine, run_at = kept["random_input"], kept["machine"], kept["run"]
    replay = kept["corpus_replay"]
    examples, code = random_input["examples"], random_input["code"]
    uncommitted = run_at["uncommitted"]
    rendered = checkout()["commit"]
    lines = [
        "# Reliability",
        "",
        "Faults injected into real daemon and client processes, bad input, and a soak of many",
        "concurrent clients, with what came of each. Produced by `make reliability` (this file is",
        "its output; the fast CI tests in `tests/store/test_faults.py` run each fault once).",
        "",
        f"Run at commit `{run_at['commit']}`, started {run_at['date']}"
        + (
            f" (this text rendered from its kept results at commit `{rendered}`)"
            if rendered != run_at["commit"]
            else ""
        )
        + (
            f"; the shared checkout also held uncommitted changes to {len(uncommitted)} tracked "
            f"files ({', '.join(f'`{u}`' for u in uncommitted)}), which the daemon built from "
            "it may include."
            if uncommitted
            else "; no uncommitted changes to tracked files."
        ),
        (
            f"Settings: `asyncflow reliability --trials {run_at['trials']} --soak-seconds "
            f"{run_at['soak_seconds']:g} --examples {examples}`, after the fuzz run below."
        ),
        "",
        (
            f"Machine: {machine['cpu']}, {platform.machine()}, {platform.system()} "
            f"{platform.release()}, {_cores()} cores; load average 1 / 5 / 15 min "
            f"{machine['load_before']} at the start, {machine['load_after']} at the end (which "
            "counts this run's own soak and random-input tests). "
            f"The faults, soak, random-input tests and corpus replay took "
            f"{machine['minutes']:.0f} min."
        ),
        "",
        "## Faults",
        "",
        "Each trial starts fresh daemons. *rows*: rows whose outcome was checked (for a producer",
        "kill: the rows of every put the producer recorded as returned, in a file it synced after",
        "each put returned and before the next); *lost*: rows a client was told were put, never",
        "acked, and not there whole afterwards; *duplicated*: rows committed (acked) twice, or",
        "delivered again after an ack returned; *partial*: rows seen with some fields or bytes",
        "missing, or a put seen half applied; *crashes*: a daemon that died on its own, a client",
        "that hung, or a trial that could not finish. *Client errors* are the errors clients",
        "were told to expect: a put or ack in flight when its daemon was killed fails saying it",
        "may or may not have been applied, an ack of a lease from before a restart fails with",
        "LeaseError (its rows come again). For the last four rows, the daemon's defences, it",
        "counts each refusal or recovery that was expected and happened; any that did not is a",
        "crash or a note below. The consumer rows hold 600 s leases: their rows come again",
        "within the 30 s the drain waits only because the killed consumer's connection gives",
        "its leases back after its 1 s `--reconnect-grace`.",
        "",
        (
            "| fault | trials | rows | lost | duplicated | partial | crashes | client errors "
            "| outcome |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
        *[r.markdown() for r in rows],
        "",
        *[f"- {r.fault}: {n}" for r in rows for n in r.notes],
        "",
        "The three `--fsync` rows kill the daemon's process, not the machine: the kernel's page",
        "cache keeps every write the daemon made, synced or not, so they test recovery from the",
        "log after the process dies, and every policy is expected to pass them alike. No row",
        "here injects a machine crash or power cut, where only what reached the disk survives;",
        "by design `--fsync always` syncs each change before it is acknowledged and the other",
        "policies may lose acknowledged changes not yet synced (design, not measured here).",
        "",
        "## Memory floods",
        "",
        "Clients that make the daemon hold memory: four connections announce a put and stall",
        "part-way (each gives up writing once the daemon has read nothing of its for 3 s), or one",
        "connection pipelines claims (each waiting 1 ms for rows that never come) and never",
        "reads a reply. The daemon runs with `--memory-limit 256MiB` and the default",
        "`--max-transit-bytes 256MiB`; *peak RSS* is the kernel's high-water mark of its",
        "resident memory (`VmHWM`), read with the flood's sockets still open. A flood passes if",
        "the peak stays within the start plus the limit plus the transit pool. A put larger than",
        "the limit is refused before its bytes are kept (they are read and dropped); one that",
        "fits is paid from the store or the pool before it is read, and the others wait unread;",
        "a connection with 4 MiB of replies queued stops being read.",
        "",
        *flood_lines([hardening.Flood(**f) for f in kept.get("floods", [])]),
        "",
        "## Bad input",
        "",
        "| input | executions | crashes |",
        "|---|---:|---:|",
        (
            f"| `cargo fuzz run decode_frame` (frames, requests, replies, log records) | {runs} "
            f"in {seconds:.0f} s | {crashes} |"
        ),
        (
            f"| fuzz corpus (`{CORPUS.relative_to('crates/asyncflow-proto')}`) replayed by "
            f"`cargo test` | {replay['inputs']} inputs ({replay['checked_in']} checked in) | "
            f"test {replay['outcome']} |"
        ),
        (
            f"| hypothesis: random dtypes, shapes, lengths, options (embedded and daemon) "
            f"| {examples} examples per test | {'0' if code == 0 else 'see below'} |"
        ),
        "",
        f"Corpus replay: `{replay['command']}`: `{replay['summary']}`.",
        f"Random-input tests: `{random_input['summary']}`.",
        *[f"- `{r}`" for r in random_input.get("reasons", [])],
        "",
        "## Soak",
        "",
        "64 clients at once — 32 threads of one process and 8 processes of 4 threads, each",
        "with its own connection — put 8 rows, claim up to 8, check and ack them, in a loop.",
        "*calls/s* counts put, claim and ack calls together. *lost*: rows whose put returned",
        "that no client acked by the end, nor a last consumer that waits out the 30 s lease",
        "timeout for rows leased by a claim whose reply failed.",
        "",
        *soak_lines(soaks),
        "",
        *soak_errors(soaks),
    ]
    failed = any("FAILED" in r.markdown() for r in rows) or not all(s.clean for s in soaks)
    failed = failed or not all(hardening.Flood(**f).ok for f in kept.get("floods", []))
    failed = failed or replay["outcome"] != "passed"
    return "\n".join(lines), failed or code != 0 or crashes > 0


def _cores() -> int:
    return os.cpu_count() or 0
