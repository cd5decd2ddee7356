"""Emulated engines behind the real :class:`RolloutEngine` / :class:`TrainEngine` interfaces, so
the real workers drive them. They spend the cost model's time on emulated devices instead of
computing, and return data of the right shape: responses of the modelled lengths (one stored
token per ``compression`` modelled tokens), zero log-probs, and a small fixed set of weights.

The emulated task, tokenizer and verifier complete the set: prompts carry their group number (a
response's length is a function of its prompt, so every mode sees the same workload), and the
verifier spends its modelled time and reads no text.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import threading
import time
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from asyncflow.bench.costs import CostModel
from asyncflow.bench.emulation.devices import DecodeDevice, DevicePool, _Sequence
from asyncflow.engines.base import (
    Completion,
    LossFn,
    Request,
    RolloutEngine,
    Sampling,
    TrainBatch,
    TrainEngine,
)
from asyncflow.models.tokenizer import Messages, Tools
from asyncflow.scheduler import partition
from asyncflow.tasks.base import Problem

#: Token id of every stored response token (a digit: its value never matters).
FILLER_TOKEN = 2

F = TypeVar("F", bound=Callable[..., Any])


class CallsCpu:
    """CPU the emulation spends in the real workers' own threads: in their calls to the emulated
    engines and verifier, which stand for an accelerator's work and a reward function's, neither
    the framework's. A call made inside another is counted once, with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = threading.local()
        self.seconds = 0.0

    def counted(self, method: F) -> F:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0:
                    spent = time.thread_time() - start
                    with self._lock:
                        self.seconds += spent

        return call  # type: ignore[return-value]


#: This process's emulated calls.
CALLS = CallsCpu()


def stored_tokens(modelled: float, compression: float) -> int:
    return max(1, math.ceil(modelled / compression))


def response_lengths(prompt: list[int], n: int, costs: CostModel) -> list[int]:
    """Modelled lengths of the ``n`` responses to ``prompt``: a function of the prompt alone."""
    w = costs.workload
    rng = np.random.default_rng([w.seed, zlib.crc32(np.asarray(prompt, np.int64).tobytes())])
    draws = rng.lognormal(math.log(w.response_median_tokens), w.response_sigma, n)
    return [int(x) for x in np.clip(np.rint(draws), 1, w.response_max_tokens)]


class EmulatedRollout(RolloutEngine):
    """Generation on one emulated device; several workers may call it at once (their sequences
    share the device's batch), and weights load while calls are in flight."""

    name = "emulated"

    def __init__(self, device: DecodeDevice, costs: CostModel, load_s: float) -> None:
        super().__init__()
        self.device = device
        self.costs = costs
        self.load_s = load_s
        self._load_lock = threading.Lock()

    @CALLS.counted
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        c = self.costs.emulation.compression
        cap = self.costs.workload.response_max_tokens
        lengths = [response_lengths(p, sampling.n, self.costs) for p in prompts]
        flat = [n for group in lengths for n in group]
        self.device.generate(flat, self.costs.workload.prompt_tokens)
        return [
            [
                Completion(
                    token_ids=[FILLER_TOKEN] * stored_tokens(n, c),
                    logprobs=[0.0] * stored_tokens(n, c),
                    text="",
                    finish_reason="length" if n >= cap else "stop",
                )
                for n in group
            ]
            for group in lengths
        ]

    @CALLS.counted
    def wait_for_room(self, timeout: float) -> bool:
        return self.device.wait_for_room(timeout)

    @CALLS.counted
    def load_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        with self._load_lock:
            if version <= self.version:
                return  # another worker sharing this engine loaded it already
            for _, tensor in weights:
                float(tensor.view(-1)[0])  # touch the received bytes
            self.device.pause(self.load_s)
            self.version = version


@dataclass
class _Flight:
    """A request on the device: its modelled length, and from which modelled token on each
    version sampled it."""

    request: Request
    sequence: _Sequence
    length: int
    switches: list[tuple[int, int]]

    def generated(self) -> int:
        return self.length - self.sequence.remaining

    def version_at(self, token: int) -> int:
        return [v for start, v in self.switches if start <= token][-1]


class EmulatedPartialRollout(EmulatedRollout):
    """The request-level loop (``rollout.partial``) on one emulated device. A request's length
    is that of its sample in :func:`response_lengths` (its key is ``(group, sample)``, as the
    partial rollout worker makes it); weights load while its sequences decode (``continue``), or
    after they are cut (``abort``: re-admitted, prompt and prefix are prefilled again). Stored
    token ``i`` stands for modelled token ``i * compression`` and carries its version."""

    supports_requests = True

    def __init__(
        self, device: DecodeDevice, costs: CostModel, load_s: float, step_timeout: float
    ) -> None:
        super().__init__(device, costs, load_s)
        self.step_timeout = step_timeout
        self._flights: list[_Flight] = []
        self._finished = threading.Event()
        #: Each cut request's flight, by key: the modelled tokens it had decoded (more than its
        #: stored tokens stand for, one per ``compression``), which its re-admission does not
        #: decode again, and the versions that sampled them.
        self._cut: dict[Any, _Flight] = {}

    @CALLS.counted
    def add_request(self, request: Request) -> None:
        c = self.costs.emulation.compression
        sample = request.key[1]
        n = self.costs.workload.group_size
        length = response_lengths(request.prompt, n, self.costs)[sample]
        before = self._cut.pop(request.key, None)
        done = before.generated() if before else int(len(request.token_ids) * c)
        prefill = self.costs.workload.prompt_tokens + done
        seq = self.device.start(max(1, length - done), prefill, self._finished.set)
        switches = [*(before.switches if before else []), (done, self.version)]
        self._flights.append(_Flight(request, seq, length, switches))

    @CALLS.counted
    def step(self) -> list[Request]:
        self._finished.wait(self.step_timeout)
        self._finished.clear()
        done = [f for f in self._flights if f.sequence.call.done.is_set()]
        if not done:
            return []
        self._flights = [f for f in self._flights if not f.sequence.call.done.is_set()]
        cap = self.costs.workload.response_max_tokens
        for f in done:
            self._fill(f, stored_tokens(f.length, self.costs.emulation.compression))
            f.request.finish_reason = "length" if f.length >= cap else "stop"
        return [f.request for f in done]

    @CALLS.counted
    def abort_requests(self, keys: Collection[Any] | None = None) -> list[Request]:
        self.device.pause(0.0)  # the serving thread credits the steps decoded so far
        chosen = [f for f in self._flights if keys is None or f.request.key in keys]
        # A sequence that ended on the device is step()'s to return, not cut: it would be
        # decoded again, and its last stored token tagged with the next version.
        cut = {id(s) for s in self.device.cut([f.sequence for f in chosen])}
        flights = [f for f in chosen if id(f.sequence) in cut]
        self._flights = [f for f in self._flights if id(f.sequence) not in cut]
        c = self.costs.emulation.compression
        for f in flights:
            self._cut[f.request.key] = f
            self._fill(f, int(f.generated() // c))
        return [f.request for f in flights]

    def in_flight(self) -> int:
        return len(self._flights)

    @CALLS.counted
    def finish_text(self, request: Request) -> Completion:
        return request.completion("")

    @CALLS.counted
    def load_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(version, weights)
        for f in self._flights:  # exact: the load's pause credited the steps before it
            f.switches.append((f.generated(), version))

    def _fill(self, f: _Flight, stored: int) -> None:
        c = self.costs.emulation.compression
        r = f.request
        for i in range(len(r.token_ids), stored):
            r.token_ids.append(FILLER_TOKEN)
            r.logprobs.append(0.0)
            r.versions.append(f.version_at(int(i * c)))


class DataParallelLoad:
    """Token loads of the data-parallel ranks of a pool. Each batch's rows are split into as many
    token-balanced parts as there are ranks (the real scheduler's ``partition``), the heaviest
    part going to the least-loaded rank; ranks run independently, so a batch costs what it adds
    to the busiest rank."""

    def __init__(self, ranks: int) -> None:
        self.loads = np.zeros(ranks)

    def add(self, tokens: np.ndarray) -> float:
        """Adds a batch with these per-row token counts; returns the growth of the busiest rank."""
        before = self.loads.max()
        parts = partition(tokens.astype(np.uint64), len(self.loads))
        sizes = sorted((float(tokens[p].sum()) for p in parts), reverse=True)
        order = np.argsort(self.loads)
        self.loads[order] += np.array(sizes)
        return float(self.loads.max() - before)

    def reset(self) -> None:
        """All ranks have synchronised (an optimizer step)."""
        self.loads[:] = 0


class EmulatedTrainer(TrainEngine):
    """Training (or, with ``role="reference"``, reference log-probs) data-parallel over every
    device of a pool. Publishing weights costs the modelled gather and broadcast."""

    name = "emulated"

    def __init__(
        self,
        pool: DevicePool,
        costs: CostModel,
        tokens_per_s: float,
        publish_s: float,
        role: str = "trainer",
    ) -> None:
        super().__init__()
        self.pool = pool
        self.costs = costs
        self.tokens_per_s = tokens_per_s
        self.publish_s = publish_s
        self.role = role
        self.ranks = DataParallelLoad(pool.devices)
        mib = costs.emulation.weights_mib
        self.weights = {f"layer.{i}.weight": torch.zeros(1 << 18) for i in range(mib)}

    def _compute(self, batch: TrainBatch) -> None:
        tokens = batch.attention_mask.sum(dim=1).numpy() * self.costs.emulation.compression
        self.pool.run(self.role, self.ranks.add(tokens) / self.tokens_per_s)

    @CALLS.counted
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        self._compute(batch)
        return torch.zeros(batch.input_ids.shape, dtype=torch.float32)

    @CALLS.counted
    def forward_backward(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        self._compute(batch)
        return {}

    @CALLS.counted
    def optimizer_step(self) -> dict[str, float]:
        step = self.costs.trainer.optimizer_step_s
        self.pool.run(self.role, step + self.costs.network.all_reduce_s(self.pool.devices))
        self.ranks.reset()
        self.version += 1
        return {}

    @CALLS.counted
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.publish_s > 0 and self.version > 0:
            self.pool.run("publish", self.publish_s)
        return iter(self.weights.items())

    def save(self, directory: Path) -> None:
        raise NotImplementedError("an emulated trainer holds no weights to save")

    def load(self, directory: Path) -> None:
        raise NotImplementedError("an emulated trainer holds no weights to load")

    def save_pretrained(self, directory: Path) -> None:
        raise NotImplementedError("an emulated trainer holds no weights to save")


class EmulatedTask:
    """Prompts that carry their group number, zero-padded to the stored prompt length."""

    name = "emulated"

    def __init__(self, costs: CostModel) -> None:
        self.width = stored_tokens(costs.workload.prompt_tokens, costs.emulation.compression)

    def train_stream(self, seed: int, start: int = 0) -> Iterator[Problem]:
        for k in itertools.count(start):
            yield Problem(prompt=f"{k:0{self.width}d}", answer="0")

    def eval_set(self) -> list[Problem]:
        return []


class EmulatedTokenizer:
    """Prompts are digit strings (one token per digit) with no chat template; emulated responses
    carry no text (the emulated verifier reads none), so decoding is free."""

    pad_id, eos_id = 0, 1
    stop_ids = frozenset({eos_id})
    has_chat_template = False

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return [FILLER_TOKEN + int(c) for c in text]

    def decode(self, ids: list[int], *, special: bool = False) -> str:
        return ""

    def text(self, ids: list[int]) -> str:
        return ""

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

    def encode_chat(self, messages: Messages, tools: Tools | None = None) -> list[int]:
        raise NotImplementedError("emulated prompts are plain text")


class ModelledVerifier:
    """A reward function that spends ``per_sample_s`` of modelled time per response and passes a
    random half of them. Short waits are batched into one sleep per thread."""

    def __init__(self, per_sample_s: float, compression: float) -> None:
        self.per_sample = per_sample_s / compression
        self._owed = threading.local()
        self._rng = random.Random(0)

    @CALLS.counted
    def __call__(self, response: str, truth: str) -> float:
        owed = getattr(self._owed, "seconds", 0.0) + self.per_sample
        if owed >= 1e-3:
            time.sleep(owed)
            owed = 0.0
        self._owed.seconds = owed
        return float(self._rng.random() < 0.5)
