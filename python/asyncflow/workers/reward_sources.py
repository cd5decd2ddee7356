"""Where rewards come from (``reward.type`` / ``reward.sources``), and how several combine.

- ``fn``: a Python function per row ``(response, truth[, extra_info]) -> float``; an ``async def``
  one is awaited for up to ``reward.concurrency`` rows at once; with ``reward.batched`` it takes
  lists and returns a list.
- ``model``: a local Hugging Face sequence-classification model directory, run in batches on its
  own device.
- ``http``: an OpenAI-compatible chat-completions judge: a prompt template, bounded concurrency,
  per-request timeouts, retries with exponential backoff, and a regular expression that finds
  the score in the reply.

A source never raises for a row: it returns a :class:`Failure` naming the row and the source
(a function that raised, a NaN, a value of the wrong type, a judge that timed out or answered
what the parser cannot read). The reward worker reports it and the row's whole group is left
out of training, so one bad row never stalls the pipeline.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from asyncflow.config import RewardConfig, RewardHttpConfig, RewardModelConfig
from asyncflow.errors import ConfigError


@dataclass(frozen=True)
class RewardRow:
    """What a source may judge: one response, with its prompt and ground truth."""

    index: int
    group: int
    prompt: str
    response: str
    truth: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Failure:
    """A row whose reward a source could not compute."""

    row: int
    group: int
    source: str
    reason: str

    def __str__(self) -> str:
        return f"reward source {self.source!r} failed on row {self.row} (group {self.group}): " + (
            self.reason
        )


Score = float | Failure


class RewardSource(Protocol):
    name: str

    def score(self, rows: Sequence[RewardRow]) -> list[Score]: ...


def checked(value: Any, row: RewardRow, source: str) -> Score:
    """``value`` as a finite float, or the failure that says why it is not one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return Failure(
            row.index, row.group, source, f"returned {type(value).__name__}, not a number"
        )
    number = float(value)
    if not math.isfinite(number):
        return Failure(row.index, row.group, source, f"returned {number}")
    return number


_PLACEHOLDER = re.compile(r"\{(prompt|response|truth)\}")


def _fill(template: str, row: RewardRow) -> str:
    """``template`` with its placeholders filled in one pass: a response that writes
    ``{truth}`` is scored as written, not with the ground truth put in its place."""
    values = {"prompt": row.prompt, "response": row.response, "truth": row.truth}
    return _PLACEHOLDER.sub(lambda m: values[m[1]], template)


# ---- fn ------------------------------------------------------------------------------------


class FnSource:
    """A Python function: per row, ``async def`` (concurrently), or batched (lists)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        extra: bool = False,
        batched: bool = False,
        concurrency: int = 16,
        name: str = "fn",
    ) -> None:
        self.fn = fn
        self.extra = extra
        self.batched = batched
        self.concurrency = concurrency
        self.name = name
        self.is_async = inspect.iscoroutinefunction(fn)

    def _kwargs(self, row: RewardRow) -> dict[str, Any]:
        return {"extra_info": row.extra} if self.extra else {}

    def score(self, rows: Sequence[RewardRow]) -> list[Score]:
        if not rows:
            return []
        if self.batched:
            return self._batched(rows)
        if self.is_async:
            return asyncio.run(self._concurrent(rows))
        out: list[Score] = []
        for row in rows:
            try:
                value = self.fn(row.response, row.truth, **self._kwargs(row))
            except Exception as e:  # a user function: any error is the row's failure
                out.append(self._raised(row, e))
                continue
            out.append(checked(value, row, self.name))
        return out

    def _raised(self, row: RewardRow, e: BaseException) -> Failure:
        return Failure(row.index, row.group, self.name, f"raised {type(e).__name__}: {e}")

    async def _concurrent(self, rows: Sequence[RewardRow]) -> list[Score]:
        limit = asyncio.Semaphore(self.concurrency)

        async def one(row: RewardRow) -> Score:
            async with limit:
                try:
                    value = await self.fn(row.response, row.truth, **self._kwargs(row))
                except Exception as e:
                    return self._raised(row, e)
            return checked(value, row, self.name)

        return list(await asyncio.gather(*(one(r) for r in rows)))

    def _batched(self, rows: Sequence[RewardRow]) -> list[Score]:
        args: list[Any] = [[r.response for r in rows], [r.truth for r in rows]]
        kwargs = {"extra_info": [r.extra for r in rows]} if self.extra else {}
        try:
            values = self.fn(*args, **kwargs)
            if inspect.isawaitable(values):
                values = asyncio.run(_await(values))
            values = list(values)
        except Exception as e:
            return [self._raised(r, e) for r in rows]
        if len(values) != len(rows):
            why = f"returned {len(values)} scores for {len(rows)} rows"
            return [Failure(r.index, r.group, self.name, why) for r in rows]
        return [checked(v, r, self.name) for v, r in zip(values, rows, strict=True)]


async def _await(value: Any) -> Any:
    return await value


# ---- model ---------------------------------------------------------------------------------


class ModelSource:
    """A local sequence-classification model, in batches on its own device."""

    name = "model"

    def __init__(self, config: RewardModelConfig) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(str(config.path))
        check_classifier_dir(path)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            str(path), local_files_only=True
        ).to(config.device)
        self.model.eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        labels = int(self.model.config.num_labels)
        if config.label >= labels:
            raise ConfigError(f"reward.model.label {config.label} but {path} has {labels} label(s)")
        #: A lock: the model is one engine, whatever thread asks.
        self._lock = threading.Lock()

    def score(self, rows: Sequence[RewardRow]) -> list[Score]:
        out: list[Score] = []
        size = self.config.batch_size
        for start in range(0, len(rows), size):
            out += self._score_chunk(rows[start : start + size])
        return out

    def _score_chunk(self, chunk: Sequence[RewardRow]) -> list[Score]:
        """Scores for ``chunk``; if its forward pass fails, each row's alone, so that one row
        the model cannot take (longer than its positions) fails by itself."""
        try:
            values = self._forward([_fill(self.config.template, r) for r in chunk])
        except Exception as e:
            if len(chunk) > 1:
                return [s for r in chunk for s in self._score_chunk([r])]
            why = f"forward pass raised {type(e).__name__}: {e}"
            return [Failure(r.index, r.group, self.name, why) for r in chunk]
        return [checked(v, r, self.name) for v, r in zip(values, chunk, strict=True)]

    def _forward(self, texts: list[str]) -> list[float]:
        enc = self.tokenizer(texts, return_tensors="pt", padding=True)
        enc = {k: v.to(self.config.device) for k, v in enc.items()}
        with self._lock, torch.no_grad():
            logits = self.model(**enc).logits.float()
        if self.config.probability:
            # One label: the probability its logit stands for (a softmax over it is always 1).
            one = logits.shape[-1] == 1
            logits = torch.sigmoid(logits) if one else torch.softmax(logits, dim=-1)
        return [float(v) for v in logits[:, self.config.label].cpu()]


def check_classifier_dir(path: Path) -> None:
    """Refuses a directory that is not a model with a sequence-classification head (a causal
    LM loaded as one would get a random, untrained head)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"reward.model.path {str(path)!r} has no config.json")
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ConfigError(
            f"reward.model.path {str(path)!r} has no sequence-classification head "
            f"(architectures: {architectures}); a reward model must be one"
        )


# ---- http ----------------------------------------------------------------------------------


@dataclass
class JudgeCounts:
    requests: int = 0
    retries: int = 0
    failures: int = 0


class HttpSource:
    """An OpenAI-compatible judge. ``sleep`` waits between retries (injectable for tests)."""

    name = "http"

    def __init__(
        self, config: RewardHttpConfig, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self.config = config
        self.endpoint = str(config.url).rstrip("/") + "/chat/completions"
        self.pattern = re.compile(config.score_pattern)
        self.sleep = sleep
        self.counts = JudgeCounts()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="judge")
        key = os.environ.get(config.api_key_env) if config.api_key_env else None
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"

    def score(self, rows: Sequence[RewardRow]) -> list[Score]:
        return list(self._pool.map(self._one, rows))

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self.counts, k, getattr(self.counts, k) + v)

    def _one(self, row: RewardRow) -> Score:
        c = self.config
        body = json.dumps(
            {
                "model": c.model,
                "messages": [{"role": "user", "content": _fill(c.template, row)}],
                "temperature": 0.0,
            }
        ).encode()
        last = ""
        for attempt in range(c.retries + 1):
            if attempt:
                self._count(retries=1)
                self.sleep(c.backoff * 2 ** (attempt - 1))
            self._count(requests=1)
            try:
                request = urllib.request.Request(self.endpoint, body, self.headers, method="POST")
                with urllib.request.urlopen(request, timeout=c.timeout) as response:
                    reply = json.loads(response.read())
                text = str(reply["choices"][0]["message"]["content"])
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code} from the judge"
                continue
            except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
                last = f"{type(e).__name__}: {e}"  # timeouts, refused connections, bad JSON
                continue
            found = self.pattern.search(text)
            if found is None:  # the judge answered: asking again would not change its mind
                self._count(failures=1)
                return Failure(row.index, row.group, self.name, f"unparseable reply {text[:80]!r}")
            try:
                value = float(found.group(1))
            except ValueError:
                self._count(failures=1)
                return Failure(row.index, row.group, self.name, f"unparseable score {text[:80]!r}")
            return checked(value, row, self.name)
        self._count(failures=1)
        return Failure(
            row.index, row.group, self.name, f"no answer after {c.retries + 1} tries: {last}"
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False)


# ---- combined ------------------------------------------------------------------------------


class RewardSet:
    """Several sources, their scores summed with weights; a row any source fails on fails."""

    def __init__(self, sources: Sequence[RewardSource], weights: Sequence[float] = ()) -> None:
        self.sources = list(sources)
        self.weights = list(weights) or [1.0] * len(self.sources)

    def score(self, rows: Sequence[RewardRow]) -> tuple[np.ndarray, list[Failure]]:
        """Rewards (NaN where a source failed), and the failures."""
        total = np.zeros(len(rows), np.float64)
        failures: list[Failure] = []
        for source, weight in zip(self.sources, self.weights, strict=True):
            scores = source.score(rows)
            if len(scores) != len(rows):
                raise RuntimeError(f"reward source {source.name!r} lost rows")
            for i, s in enumerate(scores):
                if isinstance(s, Failure):
                    failures.append(s)
                    total[i] = math.nan
                else:
                    total[i] += weight * s
        return total.astype(np.float32), failures


def build_sources(config: RewardConfig, fn: Callable[..., Any] | None, extra: bool) -> RewardSet:
    """The sources ``config`` names (``fn`` already resolved when one is)."""
    sources: list[RewardSource] = []
    for kind in config.sources or [config.type]:
        if kind == "fn":
            if fn is None:
                raise ConfigError("reward source fn needs reward.fn")
            sources.append(FnSource(fn, extra, config.batched, config.concurrency))
        elif kind == "model":
            sources.append(ModelSource(config.model))
        else:
            sources.append(HttpSource(config.http))
    return RewardSet(sources, config.weights)
