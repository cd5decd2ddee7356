"""Library output that would interleave with ours, turned down before any model is loaded.

Imported by the entry points of every process that loads models (the main job, Ray worker
actors); it depends on nothing of the package, so it can sit under everything.
"""

from __future__ import annotations

import os

from transformers.utils import logging as hf_logging


def quiet_libraries() -> None:
    """Progress bars of model loading and saving would interleave with ours; models are local."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
