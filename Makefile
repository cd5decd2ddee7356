# Two entry points do all the set-up on a fresh machine (Python >= 3.11, a Rust toolchain):
#   make train   -- the main job (asyncflow train on its embedded default)
#   make test    -- the whole test suite (Rust and Python, lints and the dependency audit)
# Both install uv if needed, then let `uv sync` build the native module and install every
# dependency into .venv/.
#   make reliability -- the long run behind docs/reliability.md: the decoder fuzzed for
#                       FUZZ_RUNS executions, every fault injected many times, the soak.

UV := python3 -m uv
PYTEST_ARGS ?=
# Test processes, each running whole test files (a file's module fixtures are shared by its
# tests). Most tests wait on subprocesses, daemons and engines: two keep a 2-core machine busy.
PYTEST_WORKERS ?= 2
# ENGINES=gpu installs vLLM's CUDA build instead of its CPU build (see the README).
ENGINES ?= cpu
ENGINE_GROUPS := $(if $(filter gpu,$(ENGINES)),--no-group engines-cpu --group engines-gpu,)
# `uv run` re-syncs the environment first: with the same groups, or it would swap vLLM's build.
RUN := $(UV) run --locked $(ENGINE_GROUPS)

FUZZ_RUNS ?= 10000000
RELIABILITY_ARGS ?=
CARGO_DENY_VERSION := 0.20.2

.PHONY: setup train test test-rust test-python lint audit reliability bench \
	bench-store bench-sched bench-pipeline bench-sim bench-e2e bench-weights

setup:
	@python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install --quiet uv
	$(UV) sync --locked $(ENGINE_GROUPS)

train: setup
	$(RUN) asyncflow train

test: setup lint audit test-rust test-python

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	$(RUN) ruff check python tests benches
	$(RUN) ruff format --check python tests benches
	$(RUN) mypy
	$(RUN) python -m mypy.stubtest asyncflow._native

# Licenses, banned and duplicate crates, sources, and known vulnerabilities (RustSec), by
# cargo-deny (installed here if missing). See .ci/audit for what happens without network.
audit:
	@cargo deny --version >/dev/null 2>&1 || cargo install --locked cargo-deny --version $(CARGO_DENY_VERSION)
	bash .ci/audit

test-rust:
	cargo test --workspace --locked

test-python:
	$(RUN) pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Benchmarks (not tests): each writes bench-out/SUITE.json, .md and .png; see benches/RESULTS.md.
BENCHES := store sched pipeline sim e2e weights

bench: $(addprefix bench-,$(BENCHES))

$(addprefix bench-,$(BENCHES)): bench-%: setup
	$(RUN) asyncflow bench $* --json bench-out/$*.json

reliability: setup
	@cargo fuzz --version >/dev/null 2>&1 || cargo install --locked cargo-fuzz
	mkdir -p bench-out
	cd crates/asyncflow-proto && RUSTC_BOOTSTRAP=1 cargo fuzz run decode_frame -O -- \
		-runs=$(FUZZ_RUNS) -print_final_stats=1 > ../../bench-out/fuzz.log 2>&1
	$(RUN) asyncflow reliability --fuzz-log bench-out/fuzz.log --out docs/reliability.md \
		$(RELIABILITY_ARGS)
