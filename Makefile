# Two entry points do all the set-up on a fresh machine (Python >= 3.11, a Rust toolchain):
#   make train   -- the main job (asyncflow train on its embedded default)
#   make test    -- the whole test suite (Rust and Python, lints included)
# Both install uv if needed, then let `uv sync` build the native module and install every
# dependency into .venv/.

UV := python3 -m uv
PYTEST_ARGS ?=

.PHONY: setup train test test-rust test-python lint bench bench-store bench-sched bench-pipeline bench-sim bench-e2e

setup:
	@python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install --quiet uv
	$(UV) sync --locked

train: setup
	$(UV) run asyncflow train

test: setup lint test-rust test-python

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	$(UV) run ruff check python tests benches
	$(UV) run ruff format --check python tests benches
	$(UV) run mypy
	$(UV) run python -m mypy.stubtest asyncflow._native

test-rust:
	cargo test --workspace --locked

test-python:
	$(UV) run pytest $(PYTEST_ARGS)

# Benchmarks (not tests): each writes bench-out/SUITE.json, .md and .png; see benches/RESULTS.md.
BENCHES := store sched pipeline sim e2e

bench: $(addprefix bench-,$(BENCHES))

$(addprefix bench-,$(BENCHES)): bench-%: setup
	$(UV) run asyncflow bench $* --json bench-out/$*.json
