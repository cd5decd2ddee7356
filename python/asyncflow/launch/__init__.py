"""Launchers place the workers: ``local`` runs them as threads of this process."""

import os

# A Ray driver started by `uv run` makes Ray start every worker with `uv run` in a copy of the
# working directory, which builds this package again, Rust extension and all, for each new copy:
# minutes per node before the first actor starts. Workers run in the driver's environment
# instead (on a cluster: the same virtual environment on a shared path). Ray reads this when it
# is imported, so it is set here, before the Ray launcher's modules import it; export
# RAY_ENABLE_UV_RUN_RUNTIME_ENV=1 for Ray's behaviour.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
