# Two entry points do all the set-up on a fresh machine (Python >= 3.11, a Rust toolchain):
#   make train   -- the main job (asyncflow train on its embedded default)
#   make test    -- the whole test suite (Rust and Python, lints included)
# Both install uv if needed, then let `uv sync` build the native module and install every
# dependency into .venv/.

UV := python3 -m uv
PYTEST_ARGS ?=
# ENGINES=gpu installs vLLM's CUDA build instead of its CPU build (see the README).
ENGINES ?= cpu
ENGINE_GROUPS := $(if $(filter gpu,$(ENGINES)),--no-group engines-cpu --group engines-gpu,)
# `uv run` re-syncs the environment first: with the same groups, or it would swap vLLM's build.
RUN := $(UV) run --locked $(ENGINE_GROUPS)

.PHONY: setup train test test-rust test-python lint bench bench-store bench-sched bench-pipeline bench-sim bench-e2e

setup:
	@python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install --quiet uv
	$(UV) sync --locked $(ENGINE_GROUPS)

train: setup
	$(RUN) asyncflow train

test: setup lint test-rust test-python

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	$(RUN) ruff check python tests benches
	$(RUN) ruff format --check python tests benches
	$(RUN) mypy
	$(RUN) python -m mypy.stubtest asyncflow._native

test-rust:
	cargo test --workspace --locked

test-python:
	$(RUN) pytest $(PYTEST_ARGS)

# Benchmarks (not tests): each writes bench-out/SUITE.json, .md and .png; see benches/RESULTS.md.
BENCHES := store sched pipeline sim e2e

bench: $(addprefix bench-,$(BENCHES))

$(addprefix bench-,$(BENCHES)): bench-%: setup
	$(RUN) asyncflow bench $* --json bench-out/$*.json
