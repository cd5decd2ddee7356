"""The engine interfaces.

A rollout engine generates responses with per-token log-probs under the policy version it holds,
and swaps in newer weights between generation batches. A train engine computes per-token
log-probs, accumulates gradients over micro-batches, steps the optimiser, and exports its full
weights for publication. Log-probs everywhere are of the temperature-scaled distribution the
responses were sampled from.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: AdamW's betas in every train engine, the critic's and the warm start's (torch's default beta2
#: is 0.999); a peer given the job's work gets them too.
ADAM_BETAS = (0.9, 0.99)


@dataclass(frozen=True)
class Sampling:
    n: int = 1
    temperature: float = 1.0
    max_tokens: int = 16
    #: Greedy decoding (temperature is then ignored).
    greedy: bool = False
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class Completion:
    token_ids: list[int]
    #: Log-prob of each generated token under the sampling distribution.
    logprobs: list[float]
    text: str
    #: ``"stop"`` (end of sequence or a stop string) or ``"length"`` (cut: out of tokens, or cut
    #: by the engine for another reason).
    finish_reason: str = "stop"
    #: The policy version that sampled each token (None: all by the version the call began
    #: with, as engines that load weights only between calls do).
    token_versions: list[int] | None = None


@dataclass
class Request:
    """One sequence of the request-level loop: its prompt and what has been generated so far,
    each token with the log-prob it was sampled with and the policy version that sampled it.
    An aborted request keeps these; added again, its prompt and prefix are prefilled anew."""

    key: Any
    prompt: list[int]
    sampling: Sampling
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    #: None while in flight; then ``"stop"`` or ``"length"``.
    finish_reason: str | None = None

    @property
    def remaining(self) -> int:
        return self.sampling.max_tokens - len(self.token_ids)

    def completion(self, text: str) -> Completion:
        return Completion(
            list(self.token_ids),
            list(self.logprobs),
            text,
            self.finish_reason or "length",
            list(self.versions),
        )


class RolloutEngine(ABC):
    """Generates responses; holds one policy version at a time."""

    name: str = "rollout"
    #: Which engine of the run this is (in logs and errors).
    label: str = "rollout"

    def __init__(self) -> None:
        self.version = 0
        #: Held by the worker loading new weights into this engine, so that workers sharing it
        #: load each version once.
        self.load_lock = threading.Lock()

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        """``sampling.n`` completions for each prompt (given as token ids)."""

    @abstractmethod
    def load_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replaces the weights in place (no restart) and records ``version``."""

    #: Whether the engine runs the request-level loop (:meth:`add_request`, :meth:`step`,
    #: :meth:`abort_requests`), which ``rollout.partial`` needs.
    supports_requests: bool = False

    def add_request(self, request: Request) -> None:
        """Queues ``request`` (one sequence, ``sampling.n`` ignored); it is admitted by a later
        :meth:`step` once fewer than the engine's ``max_num_seqs`` are in flight."""
        raise NotImplementedError(f"rollout engine {self.name!r} has no request-level loop")

    def step(self) -> list[Request]:
        """One decode step of every sequence in flight (admitting queued ones first); returns
        the requests that finished in it."""
        raise NotImplementedError(f"rollout engine {self.name!r} has no request-level loop")

    def abort_requests(self, keys: Collection[Any] | None = None) -> list[Request]:
        """Cuts the queued and in-flight requests whose ``key`` is in ``keys`` (default: every
        one); returns them with their prefix so far."""
        raise NotImplementedError(f"rollout engine {self.name!r} has no request-level loop")

    def in_flight(self) -> int:
        """Requests queued or being generated."""
        return 0

    def finish_text(self, request: Request) -> Completion:
        """The finished ``request`` as a completion: its text decoded, cut at a stop string."""
        raise NotImplementedError(f"rollout engine {self.name!r} has no request-level loop")

    def wait_for_room(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds until a new call's sequences would start at once;
        returns whether they would. An engine that batches the calls of several workers says so
        when no sequence is waiting for a slot, so that its workers claim prompts only as fast as
        it takes them (claimed prompts queued behind a full batch are work no other engine can
        pick up). The default always has room."""
        return True

    def sleep(self) -> None:  # noqa: B027 - optional hook
        """Frees the engine's device memory while a trainer on the same device steps
        (``rollout.sleep_while_training``); no other call comes until :meth:`wake_up`. The
        default keeps everything: an engine that cannot sleep simply stays."""

    def wake_up(self) -> None:  # noqa: B027 - optional hook
        """Takes the memory back after :meth:`sleep`, with the weights it had (newer ones are
        loaded after this, never into a sleeping engine)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Frees the engine's resources."""


@dataclass
class TrainBatch:
    """One micro-batch of prompt+response sequences: right-padded to a common length, one per
    row, or packed (several end to end in a row, ``position_ids`` restarting at each, and
    ``sequence_ids`` telling which sequence each token belongs to)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    #: 1 where the token at that position is a response token (its log-prob is trained).
    response_mask: torch.Tensor
    #: Extra per-row or per-token tensors the loss needs (advantages, behaviour log-probs, ...).
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    position_ids: torch.Tensor | None = None
    sequence_ids: torch.Tensor | None = None
    #: Packed with shared prompts (see ``workers.batches``): ``[rows, 1, width, width]``, True
    #: where a token attends to another; and the position of each token's logits (``[rows,
    #: width]``; a response's first token is predicted at its prompt's last).
    shared_mask: torch.Tensor | None = None
    logit_source: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.position_ids is not None

    @property
    def tokens(self) -> int:
        """Tokens of the sequences (padding excluded)."""
        return int(self.attention_mask.sum())

    @property
    def sequences(self) -> int:
        if self.sequence_ids is None:
            return int(self.input_ids.shape[0])
        return int(self.sequence_ids.max()) + 1 if self.sequence_ids.numel() else 0

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of a transformers forward pass. Packed, there is no attention mask:
        the positions mark where each sequence starts, and attention stays within it."""
        common = {"input_ids": self.input_ids, "use_cache": False}
        if self.position_ids is None:
            return {**common, "attention_mask": self.attention_mask}
        if self.shared_mask is not None:
            return {**common, "position_ids": self.position_ids, "attention_mask": self.shared_mask}
        # Without a cache and a mask, transformers reads sequence boundaries from the positions.
        return {**common, "position_ids": self.position_ids}

    def on(self, device: torch.device) -> TrainBatch:
        """This batch if it is on ``device`` already, else a copy there (:meth:`to`)."""
        return self if self.input_ids.device == device else self.to(device)

    def to(self, device: torch.device | str) -> TrainBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return TrainBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.response_mask.to(device),
            {k: v.to(device) for k, v in self.extras.items()},
            move(self.position_ids),
            move(self.sequence_ids),
            move(self.shared_mask),
            move(self.logit_source),
        )


#: Maps the engine's per-token log-probs ``[batch, length]`` and the batch to (loss, stats).
LossFn = Callable[[torch.Tensor, TrainBatch], tuple[torch.Tensor, dict[str, float]]]


class TrainEngine(ABC):
    """Trains the policy; ``version`` counts optimiser steps since the start."""

    name: str = "train"

    def __init__(self) -> None:
        self.version = 0

    @property
    def model_config(self) -> Any:
        """The transformers config of the model it trains (its sizes), or None."""
        return None

    @abstractmethod
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token log-probs ``[batch, length]`` without gradients (position ``t`` holds
        ``log p(input_ids[t] | input_ids[:t])``; position 0 is 0)."""

    @abstractmethod
    def forward_backward(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """Accumulates the gradients of ``loss_fn`` on one micro-batch. A step's gradient is the
        sum of its micro-batches' (``loss_fn`` gives each its share of the step's loss), however
        many there are."""

    @abstractmethod
    def optimizer_step(self) -> dict[str, float]:
        """Applies the accumulated gradients (clipped), clears them, bumps ``version``; returns
        e.g. the gradient norm and learning rate."""

    @abstractmethod
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (gathered) weights by Hugging Face parameter name."""

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Writes a checkpoint (model, optimiser, version)."""

    @abstractmethod
    def load(self, directory: Path) -> None:
        """Restores a checkpoint written by :meth:`save`."""

    @abstractmethod
    def save_pretrained(self, directory: Path) -> None:
        """Writes the policy as a Hugging Face model directory."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Frees the engine's resources."""


class StepTrainEngine(TrainEngine):
    """A train engine whose data-parallel ranks (in processes of their own) claim and train each
    step's samples themselves and publish the new weights; the trainer asks for a step and
    records what it trained. Its other methods act on all ranks."""

    @abstractmethod
    def train_step(self, step: int, stop: threading.Event) -> StepResult | None:
        """Trains step ``step`` (its samples are in the store's partition ``step-<step>``), bumps
        ``version`` and publishes it; None if ``stop`` was set before the step finished."""

    @abstractmethod
    def wait_started(self) -> None:
        """Waits until every rank has started (they start beside the job's other engines and
        its first evaluation)."""


def token_logprobs(logits: torch.Tensor, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """``log p(input_ids[t] | what t follows)`` from next-token ``logits`` (``[B, L, V]``),
    aligned to ``t``: the logits at ``t - 1`` (position 0 gets 0), or at the batch's
    ``logit_source``."""
    input_ids = batch.input_ids
    if batch.logit_source is not None:
        where = batch.logit_source.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        logp = torch.log_softmax(logits.gather(1, where).float() / temperature, dim=-1)
        return logp.gather(-1, input_ids.unsqueeze(-1)).squeeze(-1)
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def padded_tokens(lengths: Sequence[int]) -> int:
    """What a padded micro-batch of these rows holds: rows times the longest."""
    return len(lengths) * max(lengths, default=0)


@dataclass
class StepResult:
    """What one step trained, and its optimiser's figures."""

    trained_groups: list[int] = field(default_factory=list)
    dropped_groups: list[int] = field(default_factory=list)
    #: Trained samples by age (policy versions behind the step).
    staleness: Counter[int] = field(default_factory=Counter)
    rewards: list[float] = field(default_factory=list)
    #: Sums over the trained samples of figures kept per sample (in agent runs: turns, tool
    #: seconds, cut trajectories, failures), reported as means per trained sample.
    sample_sums: Counter[str] = field(default_factory=Counter)
    loss_stats: list[dict[str, float]] = field(default_factory=list)
    optimizer: dict[str, float] = field(default_factory=dict)
    #: Tokens the micro-batches computed (a shared prompt once); the trained samples' own tokens
    #: (each with its prompt); tokens the micro-batches' tensors held (padding too); and what
    #: the same micro-batches would hold padded (rows times the longest).
    tokens: int = 0
    sample_tokens: int = 0
    tensor_tokens: int = 0
    padded_tokens: int = 0
    #: The most tokens one micro-batch's tensors held.
    largest_micro_batch: int = 0
    #: Seconds the trainer (rank 0) took to publish the step's new version: exporting it, and
    #: handing it over (into the store, or until the receivers of a weight-sync group have it).
    publish_seconds: float | None = None
    #: Seconds ranks in processes of their own (rank 0) waited for the step's samples before
    #: training on them.
    wait_seconds: float = 0.0

    def count_batch(self, batch: TrainBatch, lengths: Sequence[int]) -> None:
        self.tokens += batch.tokens
        self.sample_tokens += sum(lengths)
        self.tensor_tokens += int(batch.input_ids.numel())
        self.largest_micro_batch = max(self.largest_micro_batch, int(batch.input_ids.numel()))
        self.padded_tokens += padded_tokens(lengths)

    def padding(self) -> dict[str, float]:
        """Padding's share of the tensors trained on, and its share had they been padded; and
        the share of the samples' tokens not computed because their prompt was shared."""
        if not self.tensor_tokens:
            return {}
        return {
            "padding_fraction": 1 - self.tokens / self.tensor_tokens,
            "padding_fraction_unpacked": 1 - self.sample_tokens / max(self.padded_tokens, 1),
            "shared_token_fraction": 1 - self.tokens / max(self.sample_tokens, 1),
            "micro_batch_tokens_max": float(self.largest_micro_batch),
        }

    def note(
        self,
        groups: np.ndarray,
        ages: np.ndarray,
        stale: np.ndarray,
        rewards: Sequence[Any],
        sums: Mapping[str, float] | None = None,
    ) -> None:
        """Records a claim's rows: the ``stale`` ones as dropped, the others as trained (with
        their ``rewards``, and their ``sums`` of figures kept per sample)."""
        self.dropped_groups += sorted({int(g) for g in groups[stale]})
        self.trained_groups += sorted({int(g) for g in groups[~stale]})
        self.staleness.update(int(a) for a in ages[~stale])
        self.rewards += [float(r) for r in rewards]
        self.sample_sums.update(sums or {})

    def sample_means(self) -> dict[str, float]:
        """Each figure kept per sample, as its mean over the trained samples (``NAME_mean``)."""
        n = max(len(self.rewards), 1)
        return {f"{name}_mean": total / n for name, total in sorted(self.sample_sums.items())}

    @staticmethod
    def merge(parts: Sequence[StepResult]) -> StepResult:
        """The step as a whole, from its data-parallel ranks' parts (figures of the first)."""
        merged = StepResult(
            optimizer=dict(parts[0].optimizer) if parts else {},
            publish_seconds=parts[0].publish_seconds if parts else None,
            wait_seconds=parts[0].wait_seconds if parts else 0.0,
        )
        for p in parts:
            merged.trained_groups += p.trained_groups
            merged.dropped_groups += p.dropped_groups
            merged.staleness += p.staleness
            merged.rewards += p.rewards
            merged.sample_sums.update(p.sample_sums)
            merged.loss_stats += p.loss_stats
            merged.tokens += p.tokens
            merged.sample_tokens += p.sample_tokens
            merged.tensor_tokens += p.tensor_tokens
            merged.padded_tokens += p.padded_tokens
            merged.largest_micro_batch = max(merged.largest_micro_batch, p.largest_micro_batch)
        merged.trained_groups.sort()
        merged.dropped_groups.sort()
        return merged
