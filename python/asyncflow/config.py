"""Run configuration: typed sections, loaded from YAML plus dotted ``key=value`` overrides, and
validated completely before any worker starts.

Every key has a default, so ``Config()`` is the embedded default job. Unknown keys, wrong types
and impossible sizes raise :class:`ConfigError` naming the key (with a suggestion for typos).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from asyncflow.errors import ConfigError
from asyncflow.units import parse_size


@dataclass
class LoraConfig:
    """``model.lora``: train low-rank adapters (peft's LoRA) instead of the full model. Only the
    adapters' weights change; each published version is the base weights with the adapters
    merged in (see docs/lora.md)."""

    #: Rank of each adapter's two factors, and its scale ``alpha / rank``.
    rank: int = 8
    alpha: float = 16.0
    #: Names of the linear modules that get adapters (the last part of a module's name, e.g.
    #: ``q_proj``); each must name at least one linear module of the model.
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    #: Dropout on the adapters' input while training.
    dropout: float = 0.0


@dataclass
class ModelConfig:
    #: A Hugging Face model directory; None creates the built-in tiny Qwen2 model locally.
    path: str | None = None
    hidden_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 512
    max_positions: int = 64
    #: Compute dtype of training and rollout.
    dtype: Literal["float32", "bfloat16"] = "float32"
    #: Low-rank adapters (None: the whole model is trained).
    lora: LoraConfig | None = None


@dataclass
class DataConfig:
    #: ``arithmetic`` (built in), ``addition-longtail`` (its variant with a long tail of response
    #: lengths: operands of 2 to ``digits`` digits, a column-by-column scratchpad, scored by the
    #: ``gsm8k`` reward), ``multiply-tools`` (multi-turn, with a calculator), or ``dataset``: local
    #: files (``train_file``/``eval_file``) with verl-style columns. ``parquet`` is the older name
    #: of ``dataset``.
    task: Literal["arithmetic", "addition-longtail", "dataset", "parquet", "multiply-tools"] = (
        "arithmetic"
    )
    train_file: str | None = None
    eval_file: str | None = None
    #: ``auto`` (by the file's name: ``.parquet``, ``.json``/``.jsonl``, ``.arrow`` or a directory
    #: written by ``datasets``' ``save_to_disk``), or one of them by name.
    format: Literal["auto", "parquet", "json", "hf"] = "auto"
    #: Column of the prompt (text, or a chat: a list of ``{role, content}``), and dotted path
    #: (into struct columns) of the ground truth.
    prompt_key: str = "prompt"
    answer_key: str = "reward_model.ground_truth"
    #: Further dotted paths handed to the reward function (as ``extra_info``, by path).
    extra_keys: list[str] = field(default_factory=list)
    #: A column holding a worked answer, which the warm start demonstrates (None: the ground
    #: truth itself).
    demonstration_key: str | None = None
    #: Render prompts with the tokenizer's chat template: ``auto`` when it has one (plain-text
    #: prompts become one user message), ``true`` (required), ``false`` (plain text, as is).
    chat_template: bool | Literal["auto"] = "auto"
    #: A system message put first in every chat that has none.
    system_prompt: str | None = None
    #: Longest rendered prompt in tokens (None: the model's positions less rollout.max_tokens);
    #: longer ones are left out (``filter``, counted in the summary) or cut from the left.
    max_prompt_length: int | None = None
    truncation: Literal["filter", "truncate_left"] = "filter"
    #: Built-in task: operand digits (``addition-longtail``: the most).
    digits: int = 2
    #: Held-out problems for evaluation: the built-in task's, or, for a dataset without
    #: ``eval_file``, distinct prompts drawn from ``train_file`` at random (the same for every
    #: seed) and kept out of training.
    eval_size: int = 500


@dataclass
class WarmStartConfig:
    """A short supervised pass that makes the built-in model sometimes right (pass@k > pass@1)."""

    #: Unset: on for the built-in model, off for a model of one's own (``model.path``), which
    #: the built-in task's bare-answer demonstrations would otherwise fine-tune.
    enabled: bool | None = None
    steps: int = 600
    batch_size: int = 256
    lr: float = 3e-3
    #: Fraction of demonstrations showing the classic mistake (a dropped carry).
    mistake_rate: float = 0.6


@dataclass
class RolloutConfig:
    #: ``auto`` picks vLLM when installed, else ``hf``; or a registered engine name.
    engine: str = "auto"
    #: Responses per prompt (the GRPO group size).
    n: int = 16
    temperature: float = 1.0
    max_tokens: int = 8
    #: Prompt groups per generation call.
    groups_per_call: int = 16
    #: Rollout engines; with more than one, prompt groups are routed to the least-loaded.
    engines: int = 1
    #: Seconds an engine may go without finishing a generation call before the router takes it
    #: out of rotation and gives its prompt groups to another engine.
    heartbeat_timeout: float = 120.0
    #: vLLM: the KV cache, allocated up front; and the longest sequence (None: the model's own).
    kv_cache_memory: str = "64MiB"
    max_model_len: int | None = None
    #: vLLM: fraction of device memory (on CPU: of host memory) it checks is free at start-up.
    gpu_memory_utilization: float = 0.1
    #: vLLM: devices each engine shards its model over (tensor parallelism). Its shards then run
    #: in worker processes of vLLM's own, which receive each new version through vLLM's message
    #: queue (a copy per shard). vLLM's CPU build runs them too, but by default binds each
    #: shard's threads to a NUMA node of its own: on a machine with fewer nodes, set
    #: ``VLLM_CPU_OMP_THREADS_BIND`` (``nobind``, or one core list per shard: ``0-7|8-15``).
    tensor_parallel_size: int = 1
    #: vLLM: run the model eagerly (true) or through captured CUDA graphs (false); None: eager on
    #: CPU, CUDA graphs on a GPU (decided where each engine starts).
    enforce_eager: bool | None = None
    #: vLLM on the GPU the trainer uses (colocated): each engine sleeps while the trainer steps
    #: (vLLM's sleep level 1: its KV cache freed, its weights moved to host memory) and wakes
    #: before the next generation, then loads the version just published. Needs the synchronous
    #: mode (``trainer.max_staleness: 0``, ``staleness_policy: wait``, ``streaming: false``),
    #: ``rollout.engine: vllm``, ``rollout.partial: off``, the local launcher, and CUDA.
    sleep_while_training: bool = False
    #: Weights published while responses are being generated: ``off`` loads them between
    #: generation calls only; ``continue`` loads them between two decode steps and goes on with
    #: the in-flight sequences (their KV cache from the old weights kept); ``abort`` cuts the
    #: in-flight sequences, loads them, and re-admits the sequences with their generated prefix
    #: (prefilled again under the new weights). See docs/partial-rollout.md.
    partial: Literal["off", "continue", "abort"] = "off"
    #: Sequences the request-level loop (``partial`` other than ``off``) keeps in flight; new
    #: prompt groups are admitted as others finish.
    max_num_seqs: int = 64
    #: hf engine: where its model and tensors live, ``cpu``, ``cuda`` or ``cuda:N`` (the held-out
    #: evaluator, an hf engine, too). Results come back as Python lists wherever it runs.
    device: str = "cpu"


@dataclass
class TrainerConfig:
    #: ``auto`` picks DeepSpeed when installed, else ``hf``; or a registered engine name.
    engine: str = "auto"
    #: RL steps (each ``ppo_epochs`` optimiser steps). The default job's RL costs about a second
    #: a step on 2 CPU cores; at 30 steps two seeds of three stopped short of 0.90 held-out
    #: accuracy while still rising.
    max_steps: int = 100
    #: Prompt groups per RL step.
    groups_per_step: int = 32
    lr: float = 3e-4
    weight_decay: float = 0.0
    #: The norm the gradients are clipped to; positive (a large value clips nothing).
    grad_clip: float = 1.0
    #: Token budget of one micro-batch (gradient accumulation splits a step into these),
    #: counted as its tensors hold them: rows times their width (packed, the rows' unfilled
    #: ends count; padded, each row is as long as the longest).
    micro_batch_tokens: int = 4096
    #: Lay a micro-batch's samples end to end in rows at most as wide as the longest sample
    #: (attention kept within each sample), short samples sharing a row, instead of padding each
    #: to the longest: less compute is spent on padding.
    packing: bool = True
    #: Packed, train the samples that share a prompt (a group's) as one unit: the prompt once,
    #: each response attending to it and to itself (the same gradient, the prompt's compute
    #: done once per group). Used where it costs less: attention over the longer rows is dense,
    #: so the model's sizes and the claim's lengths decide (``workers.batches.pair_cost``); not
    #: for models with sliding-window or chunked attention layers.
    share_prompts: bool = True
    #: Train each micro-batch as soon as its samples are ready (true), or first wait until the
    #: whole step's samples are, as synchronous frameworks do (false: a baseline to compare with).
    #: Trainer ranks in processes of their own always wait (see ``dp_size``).
    streaming: bool = True
    #: Optimisation passes over each step's samples.
    ppo_epochs: int = 1
    clip_eps: float = 0.2
    #: Off-policy correction: ``none`` (PPO ratio against the behaviour policy), ``decoupled``
    #: (proximal policy clip times the behaviour importance weight) or ``tis`` (the same, weight
    #: truncated at ``is_cap``).
    correction: Literal["none", "decoupled", "tis"] = "tis"
    is_cap: float = 2.0
    kl_coef: float = 0.0
    #: Policy versions the trainer may run ahead of the samples it trains on (0: on-policy).
    max_staleness: int = 1
    #: Samples older than allowed: ``wait`` (rollout waits for fresh weights, nothing is
    #: discarded) or ``drop`` (rollout never waits; too-stale samples are discarded).
    staleness_policy: Literal["wait", "drop"] = "wait"
    #: Data-parallel ranks. More than one (or one, with ``weights.transport`` broadcast or ipc,
    #: or with ``own_process``) runs each rank in its own process; they share the store through
    #: a daemon (``store.address``, or one started for the run), and train a step once all of
    #: its samples are ready (they split it by tokens), whatever ``streaming`` says.
    dp_size: int = 1
    #: The one rank of ``dp_size`` 1 (weights through the store) in a process of its own rather
    #: than a thread of the job's process, where the rollout engine's Python and the trainer's
    #: take turns holding one interpreter lock (benches/RESULTS.md, "e2e"). ``auto``: in a
    #: process of its own when the rollout engine is vLLM (whose scheduler is Python) and no
    #: left-out groups are replaced (``algorithm.max_extra_groups``, which needs the trainer in
    #: the job's process). The local launcher only: under Ray every rank is an actor of its own.
    own_process: bool | Literal["auto"] = "auto"
    #: DeepSpeed ZeRO stage (0: plain data parallelism; 3: parameters sharded too).
    zero_stage: int = 1
    #: ``constant`` after the warm-up, or ``cosine`` decay to ``min_lr_ratio`` at ``max_steps``.
    #: Cosine by default: at a constant rate the default job's held-out accuracy moved 3-6 points
    #: between evaluations over its last 30 steps, so the final model was one draw from that band.
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    #: Seconds to wait for trainer ranks to start, and for a peer rank in any collective, before
    #: failing with an error that names the rank.
    timeout: float = 900.0
    #: hf engine (and the hf reference model of ``algorithm.reference``): where the model, its
    #: optimiser state and each micro-batch live, ``cpu``, ``cuda`` or ``cuda:N``. Log-probs come
    #: back on the CPU. DeepSpeed and FSDP place themselves (CUDA when torch sees it).
    device: str = "cpu"


#: The advantages that put the KL to the reference (``trainer.kl_coef``) in the reward; their
#: loss has no KL term.
KL_IN_REWARD = ("reinforce++", "gae")


@dataclass
class AlgorithmConfig:
    #: ``grpo``/``rloo`` (group baselines), ``reinforce++`` (rewards less ``trainer.kl_coef``
    #: times the sequence's KL to the reference, normalised over the groups the advantage worker
    #: claims together: up to 32, those rewarded by then, not a whole step), or ``gae``: PPO with
    #: a critic (see ``critic``), per-token advantages by GAE from its values.
    advantage: Literal["grpo", "rloo", "reinforce++", "gae"] = "grpo"
    #: GAE's discount and lambda (Ziegler et al. 2019, arXiv 1909.08593: 1 and 0.95).
    gamma: float = 1.0
    lam: float = 0.95
    #: GRPO: divide by the group's reward standard deviation.
    normalize_std: bool = True
    #: ``token-mean`` (``token``): the step's token losses summed and divided by a constant,
    #: rows per step times ``rollout.max_tokens`` (Dr. GRPO's normaliser: a micro-batch's share
    #: is known before the step's other samples are; DAPO divides by the tokens the step holds);
    #: ``seq-mean-token-mean`` (``sequence``): per-sequence means summed, divided by rows per
    #: step; ``seq-mean-token-sum``: per-sequence sums, divided by rows per step times
    #: ``rollout.max_tokens`` (so the same loss as ``token-mean``). Rows per step is
    #: ``groups_per_step`` times ``rollout.n``, also when a step trains fewer (groups left out).
    loss_aggregation: Literal[
        "token", "sequence", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum"
    ] = "token"
    #: ``ppo``: per-token ratio and clip; ``gspo``: one ratio per sequence (the geometric mean
    #: of its token ratios), clipped per sequence.
    policy_loss: Literal["ppo", "gspo"] = "ppo"
    #: Clip-higher: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]`` (None:
    #: ``trainer.clip_eps``).
    clip_low: float | None = None
    clip_high: float | None = None
    #: Dynamic sampling: groups whose rewards are all equal carry no signal and are not trained.
    filter_groups: bool = False
    #: With ``filter_groups``: prompt groups generated for a step in place of groups left out
    #: (all-equal rewards, or a failed reward), at most this many per step (0: none, the step
    #: trains on fewer groups). Needs ``trainer.staleness_policy: drop``: under ``wait`` a
    #: rollout engine waiting for newer weights could hold back the replacements.
    max_extra_groups: int = 0
    #: Overlong responses (cut at ``rollout.max_tokens``): ``none``, ``filter`` (left out of the
    #: loss), or ``penalty`` (reward lowered linearly over the last ``overlong_buffer`` tokens,
    #: by at most ``overlong_penalty``).
    overlong: Literal["none", "filter", "penalty"] = "none"
    overlong_buffer: int = 4
    overlong_penalty: float = 1.0
    #: Compute reference log-probs (needed for ``kl_coef > 0``).
    reference: bool = False


@dataclass
class CriticConfig:
    """The value model of ``algorithm.advantage: gae``: a task of its own that writes per-token
    ``values`` for each sample and trains on the returns, with its own optimiser."""

    #: A model directory reading the same token ids as the policy (None: a copy of the policy's
    #: starting weights); a new value head goes on top of its backbone.
    path: str | None = None
    #: Learning rate (None: ``trainer.lr``).
    lr: float | None = None
    #: A value moves at most this far from the one the sample was scored with, per update
    #: (Ziegler et al. 2019: 0.2).
    value_clip: float = 0.2


@dataclass
class RewardModelConfig:
    """``reward.type: model``: a local Hugging Face sequence-classification model directory."""

    path: str | None = None
    #: Device of the reward model (its own, apart from the policy's): ``cpu``, ``cuda:1``...
    device: str = "cpu"
    #: Responses scored per forward pass.
    batch_size: int = 32
    #: Score: the logit of this label (one-label models: their only logit), or with
    #: ``probability: true`` its softmax probability (one-label models: the logit's sigmoid).
    label: int = 0
    probability: bool = False
    #: Text given to the model: ``{prompt}``, ``{response}`` and ``{truth}`` are filled in
    #: (``{prompt}``: the prompt as the policy was given it, chat markup's special tokens left
    #: out). ``{response}`` is required.
    template: str = "{response}"


@dataclass
class RewardHttpConfig:
    """``reward.type: http``: an OpenAI-compatible chat-completions judge."""

    #: Base URL, e.g. ``http://127.0.0.1:8000/v1`` (``/chat/completions`` is appended).
    url: str | None = None
    model: str = "judge"
    #: The judge's user message; ``{prompt}``, ``{response}`` and ``{truth}`` are filled in, as
    #: in ``reward.model.template``. ``{response}`` is required.
    template: str = (
        "Question: {prompt}\nReference answer: {truth}\nResponse: {response}\n"
        "Score the response from 0 to 1. Reply with the score only."
    )
    #: The score: the first capture group of this regular expression in the judge's reply.
    score_pattern: str = r"(-?[0-9]+(?:\.[0-9]+)?)"
    #: Requests in flight at once, seconds per request, retries after the first try, and the
    #: first retry's wait in seconds (doubled on each further retry).
    concurrency: int = 8
    timeout: float = 30.0
    retries: int = 2
    backoff: float = 0.5
    #: Environment variable holding the API key sent as a bearer token (None: none sent).
    api_key_env: str | None = None


@dataclass
class RewardConfig:
    #: ``fn`` (a Python function), ``model`` (a sequence-classification model) or ``http`` (a
    #: judge endpoint); ``sources`` combines several.
    type: Literal["fn", "model", "http"] = "fn"
    #: A registered reward name, or ``module:function`` taking (response text, ground truth);
    #: an ``async def`` function is awaited, up to ``concurrency`` rows at once.
    fn: str = "exact_match"
    #: The function takes lists (responses, truths[, extra_info]) and returns a list of scores.
    batched: bool = False
    concurrency: int = 16
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    http: RewardHttpConfig = field(default_factory=RewardHttpConfig)
    #: Several sources at once (empty: ``type`` alone), their scores summed with ``weights``
    #: (empty: all 1).
    sources: list[Literal["fn", "model", "http"]] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)


@dataclass
class StoreSettings:
    #: ``embedded`` or a daemon URL ``tcp://host:port``.
    address: str = "embedded"
    token: str | None = None
    shards: int = 8
    memory_limit: str = "2GiB"
    #: Seconds claimed rows stay leased to a worker that stops renewing them (one that dies):
    #: workers renew the leases of rows they work on every third of it.
    lease_timeout: float = 60.0


@dataclass
class RayConfig:
    """``launcher: ray``: where the cluster is and what each role's actors ask of it."""

    #: The cluster to join (``auto``, ``HOST:6379``, ``ray://HOST:10001``); None: ``$RAY_ADDRESS``
    #: if set, else a Ray instance started on this machine for the run.
    address: str | None = None
    #: Resources of each rollout engine's actor, and of each data-parallel trainer rank's.
    rollout_cpus: float = 1.0
    rollout_gpus: float = 0.0
    trainer_cpus: float = 1.0
    trainer_gpus: float = 0.0
    #: CPUs of the reward and advantage actors each; the reference actor gets a trainer rank's.
    worker_cpus: float = 1.0
    #: Times Ray restarts a worker actor that died (leases hand its rows to the new one).
    max_restarts: int = 3
    #: Seconds to wait for placement groups and actors (engines loaded) before failing.
    start_timeout: float = 600.0
    #: The cluster adds nodes on demand (KubeRay, the cluster launcher): a placement more than
    #: the nodes alive now can hold waits for more (up to ``start_timeout``) instead of failing.
    autoscaling: bool = False


@dataclass
class RunConfig:
    name: str = "asyncflow"
    seed: int = 0
    #: Runs go to ``<output_dir>/<name>`` unless ``--run-dir`` is given.
    output_dir: str = "runs"
    eval_every: int = 5
    #: Evaluate after RL instead of during it: each ``eval_every`` step keeps a copy of the
    #: weights in host memory, scored once RL is over (``summary.json``'s
    #: ``deferred_evaluations``). During RL the trainer then never waits for an evaluation while
    #: the rollout goes on, so RL seconds and the times of the accuracy curve are the
    #: training's own (benchmarks; a copy per evaluation must fit in memory).
    eval_deferred: bool = False
    checkpoint_every: int = 10
    #: Seconds any worker may wait for its input before the run fails with a clear error.
    stall_timeout: float = 300.0
    #: Seconds a worker waits in one claim for a full batch before it takes what is ready; with
    #: nothing ready, the same claim waits on for the first rows (up to a second, or the poll
    #: interval). Short, so that a stage does not hold back rows the next one could start on.
    claim_wait: float = 0.02
    #: Seconds between a waiting worker's looks (new weights are looked for ten times as
    #: often), between a dispatcher's heartbeats, and a trainer's wait for a whole step.
    poll_interval: float = 0.25
    progress: bool = True
    #: Experiment trackers mirroring metrics.jsonl, the config and the summary figure:
    #: ``tensorboard``, ``wandb`` (offline unless ``WANDB_MODE`` says otherwise), ``mlflow`` (a
    #: local ``file:`` store under the run unless ``MLFLOW_TRACKING_URI`` names one). One that
    #: fails to start is warned about once and left out.
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(
        default_factory=lambda: ["tensorboard"]
    )


@dataclass
class WeightsConfig:
    """How each new policy version reaches the rollout engines (see docs/weights.md)."""

    #: ``store``: the store carries whole versions (the portable default). ``broadcast``: the
    #: trainer's rank 0 sends each version in buckets over a gloo group of its own whose one
    #: receiver is the job's process, which holds the rollout engines; the store carries only
    #: each version's layout. ``ipc``: as broadcast, but the job's process copies each version
    #: from rank 0's GPU memory through a CUDA IPC handle (needs CUDA; trainer and engines on
    #: GPUs of one machine). Both need ``launcher: local``, and run the trainer in processes of
    #: its own, even with ``trainer.dp_size`` 1.
    transport: Literal["store", "broadcast", "ipc"] = "store"
    #: Bytes per broadcast bucket: one is packed while the one before it is on the wire.
    bucket_size: str = "64MiB"
    #: Seconds a broadcast may take before every member fails (a peer died or stalled).
    timeout: float = 120.0


@dataclass
class SandboxConfig:
    """Limits of the sandboxed processes the ``python`` tool (and a calculator in a subprocess)
    runs: CPU seconds, address space of each process (a run may hold ``processes`` times
    ``memory``), wall-clock seconds (then its process group is killed), bytes of output kept,
    processes at once, and bytes of files in its working directory, a tmpfs held in memory (the
    last two as root, where the child runs under a user id of its own)."""

    cpu_seconds: int = 5
    memory: str = "512MiB"
    wall_seconds: float = 10.0
    output_bytes: int = 16384
    processes: int = 8
    disk: str = "64MiB"


@dataclass
class LatencyConfig:
    """Extra seconds before each tool answers, standing in for sandboxes and remote services:
    ``lognormal`` (``median`` seconds, log-space ``sigma``), ``fixed`` (``median``) or ``none``.
    With ``subprocess`` the calculator computes in a real sandboxed process as well."""

    distribution: Literal["none", "fixed", "lognormal"] = "none"
    median: float = 0.2
    sigma: float = 0.5
    subprocess: bool = False


@dataclass
class AgentConfig:
    """Multi-turn rollouts (see docs/agents.md): each trajectory alternates model turns and
    environment turns until the environment says done or a budget runs out."""

    enabled: bool = False
    #: A registered environment (``tools``: the model's tool calls answered by ``tools``).
    environment: str = "tools"
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    #: Give the tools' schemas to the chat template, which describes them in the prompt (as
    #: Qwen's does); the built-in model's template ignores them.
    tools_in_prompt: bool = True
    #: How tool calls are read from the model's text (``hermes``:
    #: ``<tool_call>{json}</tool_call>``).
    parser: str = "hermes"
    #: Model turns per trajectory, and tokens after the prompt (model and environment together).
    max_turns: int = 4
    max_tokens: int = 256
    #: Where a trajectory's reward comes from: ``verifier`` (``reward.fn`` on the last model
    #: turn's text), ``env`` (the rewards the environment gave) or ``both`` (summed).
    reward: Literal["verifier", "env", "both"] = "verifier"
    #: Seconds a tool call may take before it is answered with an error. Keep it above the
    #: python tool's ``sandbox.wall_seconds``: a call given up first loses the sandbox's own
    #: timeout answer, with the output so far, which the model would read.
    tool_timeout: float = 15.0
    #: The tokens that wrap an environment's observation (ChatML's, as Qwen's template writes
    #: tool responses); ``{observation}`` is replaced by its text.
    observation_template: str = (
        "\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"
    )
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    latency: LatencyConfig = field(default_factory=LatencyConfig)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    store: StoreSettings = field(default_factory=StoreSettings)
    run: RunConfig = field(default_factory=RunConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    launcher: Literal["local", "ray"] = "local"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def shareable(self) -> dict[str, Any]:
        """:meth:`to_dict` without ``store.token``: what is written to the run directory and
        sent to trackers, which other users may read (a resume takes the token from
        ``$ASYNCFLOW_TOKEN``, or ``store.token`` given again)."""
        settings = self.to_dict()
        settings["store"]["token"] = None
        return settings

    def to_yaml(self) -> str:
        """The settings as YAML, without the store's token (see :meth:`shareable`)."""
        return str(yaml.safe_dump(self.shareable(), sort_keys=False))


# ---- loading ------------------------------------------------------------------------------


#: Settings that name a file or directory: a leading ``~`` there is the user's home, as in a
#: shell (a quoted or YAML value reaches the job unexpanded, and ``~/runs`` was made in place).
PATH_SETTINGS = frozenset(
    {
        "model.path",
        "data.train_file",
        "data.eval_file",
        "critic.path",
        "reward.model.path",
        "run.output_dir",
    }
)


def _home_path(text: str, what: str) -> str:
    """``text`` with a leading ``~`` (or ``~user``) made the home directory it names."""
    if not text.startswith("~"):
        return text
    try:
        return str(Path(text).expanduser())
    except RuntimeError:
        user = text.partition("/")[0]
        raise ConfigError(f"{what} {text!r}: no home directory for {user}") from None


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Reads ``path`` (YAML; None for the defaults), applies ``key=value`` overrides, and
    validates the result."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = _load_yaml(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p} is not valid YAML: {e}") from None
        except (OSError, UnicodeError) as e:
            raise ConfigError(f"cannot read {p}: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        raw = loaded
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        _set_dotted(raw, key.strip(), _override_value(key.strip(), value))
    config: Config = _build(Config, raw, "")
    validate(config)
    return config


def _load_yaml(text: str) -> Any:
    """The document, with a text setting given as a plain number or boolean (``name: 0755``,
    ``name: yes``) kept as written: YAML reads those as 493 and True."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    if isinstance(data, dict) and isinstance(node, yaml.MappingNode):
        _as_written(data, node, "")
    return data


def _as_written(data: dict[Any, Any], node: yaml.MappingNode, prefix: str) -> None:
    for key_node, value_node in node.value:
        key = key_node.value
        if key not in data:
            continue
        value = data[key]
        if isinstance(value_node, yaml.MappingNode) and isinstance(value, dict):
            _as_written(value, value_node, f"{prefix}{key}.")
        elif (
            isinstance(value, (bool, int, float))
            and isinstance(value_node, yaml.ScalarNode)
            and value_node.style is None
            and _is_text_setting(f"{prefix}{key}")
        ):
            data[key] = value_node.value


class _UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]
    """YAML's safe loader, refusing a key given twice in one mapping: a section repeated in a
    file silently replaced the first one, settings and all."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return dict(super().construct_mapping(node, deep=deep))


def _override_value(key: str, value: str) -> Any:
    """An override's value: read as YAML, except a text setting's unquoted value, which is
    taken as written (YAML would cut it at `` #`` or read ``Q: {prompt}`` as a mapping)."""
    text = value.strip()
    if not text:
        return None
    if _is_text_setting(key) and text[0] not in "'\"" and text not in ("null", "~"):
        return text
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}={value!r}: not a YAML value: {e}") from None


def _is_text_setting(key: str) -> bool:
    """Whether the dotted ``key`` names a setting of type ``str`` or ``str | None``."""
    cls: Any = Config
    hint: Any = None
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        hint = typing.get_type_hints(cls).get(part)
        if hint is None:
            return False
        cls = _optional_section(hint, {})
    return hint is str or hint == (str | None)


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node = nxt
    node[parts[-1]] = value


def _build(cls: type, raw: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(f"unknown config key {prefix}{key}{hint}")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        hint = _optional_section(hints[f.name], raw[f.name])
        if dataclasses.is_dataclass(hint):
            values[f.name] = _build(hint, raw[f.name], f"{prefix}{f.name}.")  # type: ignore[arg-type]
        else:
            value = _coerce(raw[f.name], hint, f"{prefix}{f.name}")
            if f"{prefix}{f.name}" in PATH_SETTINGS and isinstance(value, str):
                value = _home_path(value, f"{prefix}{f.name}")
            values[f.name] = value
    return cls(**values)


def _optional_section(hint: Any, value: Any) -> Any:
    """An optional section (``Section | None``) that is given is read as the section."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and value is not None:
        sections = [o for o in typing.get_args(hint) if dataclasses.is_dataclass(o)]
        if len(sections) == 1:
            return sections[0]
    return hint


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                errors.append(str(e))
        # Each says "{key} must be X, not {value!r}": one message naming every X.
        head, tail = f"{key} must be ", f", not {value!r}"
        if all(e.startswith(head) and e.endswith(tail) for e in errors):
            wanted = " or ".join(e.removeprefix(head).removesuffix(tail) for e in errors)
            raise ConfigError(f"{head}{wanted}{tail}")
        raise ConfigError(errors[0])
    if origin is Literal:
        choices = typing.get_args(hint)
        if isinstance(value, bool):  # YAML reads off/on, no/yes as booleans
            words = ("on", "yes", "true") if value else ("off", "no", "false")
            value = next((w for w in words if w in choices), value)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {list(choices)}, not {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, not {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, not {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, not {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key} must be a string, not {value!r}")
        return str(value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, not {value!r}")
        (item,) = typing.get_args(hint)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{key}: unsupported setting type {hint}")


# ---- validation ---------------------------------------------------------------------------


def _size(key: str, text: str | None) -> int | None:
    """Setting ``key``'s size in bytes (see :func:`parse_size`); a ``ConfigError`` naming it if
    it is no size."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(c: Config) -> None:
    """Checks sizes and combinations that types alone cannot."""
    for key, value in [
        ("model.hidden_size", c.model.hidden_size),
        ("model.layers", c.model.layers),
        ("model.heads", c.model.heads),
        ("model.kv_heads", c.model.kv_heads),
        ("model.intermediate_size", c.model.intermediate_size),
        ("model.max_positions", c.model.max_positions),
        ("data.digits", c.data.digits),
        ("data.eval_size", c.data.eval_size),
        ("rollout.n", c.rollout.n),
        ("rollout.max_tokens", c.rollout.max_tokens),
        ("rollout.groups_per_call", c.rollout.groups_per_call),
        ("rollout.engines", c.rollout.engines),
        ("rollout.max_num_seqs", c.rollout.max_num_seqs),
        ("rollout.tensor_parallel_size", c.rollout.tensor_parallel_size),
        ("trainer.max_steps", c.trainer.max_steps),
        ("trainer.groups_per_step", c.trainer.groups_per_step),
        ("trainer.micro_batch_tokens", c.trainer.micro_batch_tokens),
        ("trainer.ppo_epochs", c.trainer.ppo_epochs),
        ("trainer.dp_size", c.trainer.dp_size),
        ("store.shards", c.store.shards),
        ("warm_start.steps", c.warm_start.steps),
        ("warm_start.batch_size", c.warm_start.batch_size),
        ("run.eval_every", c.run.eval_every),
        ("run.checkpoint_every", c.run.checkpoint_every),
    ]:
        _require(value >= 1, f"{key} must be at least 1, not {value}")
    _require(
        c.model.hidden_size % c.model.heads == 0,
        "model.hidden_size must be a multiple of model.heads",
    )
    _require(
        c.model.heads % c.model.kv_heads == 0, "model.heads must be a multiple of model.kv_heads"
    )
    _require(c.data.digits <= 9, "data.digits must be at most 9")
    _require(c.rollout.temperature > 0, "rollout.temperature must be positive")
    _require(c.rollout.n >= 2, "rollout.n must be at least 2: group advantages need two samples")
    if c.model.path is None:
        _require(
            c.model.max_positions > c.rollout.max_tokens,
            "model.max_positions leaves no room for a prompt before rollout.max_tokens",
        )
    for key, rate in [("trainer.lr", c.trainer.lr), ("warm_start.lr", c.warm_start.lr)]:
        _require(0 < rate < math.inf, f"{key} must be a positive number, not {rate}")
    _require(
        0 <= c.trainer.weight_decay < math.inf,
        f"trainer.weight_decay must be a number >= 0, not {c.trainer.weight_decay}",
    )
    _require(c.run.stall_timeout > 0, "run.stall_timeout must be positive")
    _size("store.memory_limit", c.store.memory_limit)
    _require(
        c.store.address == "embedded" or c.store.address.startswith("tcp://"),
        f"store.address must be embedded or a daemon's tcp://HOST:PORT, not {c.store.address!r}",
    )
    _require(
        c.trainer.grad_clip > 0,
        "trainer.grad_clip must be positive: the norm gradients are clipped to (a large value "
        "such as 1e9 clips nothing)",
    )
    _require(c.trainer.max_staleness >= 0, "trainer.max_staleness cannot be negative")
    _require(0 < c.trainer.clip_eps < 1, "trainer.clip_eps must be in (0, 1)")
    _require(c.trainer.is_cap >= 1, "trainer.is_cap must be at least 1")
    _require(c.trainer.kl_coef >= 0, "trainer.kl_coef cannot be negative")
    _require(
        c.trainer.kl_coef == 0 or c.algorithm.reference,
        "trainer.kl_coef > 0 needs algorithm.reference: true",
    )
    _require(c.trainer.zero_stage in (0, 1, 2, 3), "trainer.zero_stage must be 0, 1, 2 or 3")
    _require(
        c.trainer.groups_per_step % c.trainer.dp_size == 0,
        "trainer.groups_per_step must be a multiple of trainer.dp_size",
    )
    _require(0 <= c.warm_start.mistake_rate <= 1, "warm_start.mistake_rate must be in [0, 1]")
    _require(c.store.lease_timeout > 0, "store.lease_timeout must be positive")
    _require(c.trainer.warmup_steps >= 0, "trainer.warmup_steps cannot be negative")
    _require(0 <= c.trainer.min_lr_ratio <= 1, "trainer.min_lr_ratio must be in [0, 1]")
    _require(c.trainer.timeout > 0, "trainer.timeout must be positive")
    _require(c.rollout.heartbeat_timeout > 0, "rollout.heartbeat_timeout must be positive")
    _require(
        0 < c.rollout.gpu_memory_utilization <= 1,
        "rollout.gpu_memory_utilization must be in (0, 1]",
    )
    _require(
        (_size("rollout.kv_cache_memory", c.rollout.kv_cache_memory) or 0) > 0,
        "rollout.kv_cache_memory must be a positive size such as 64MiB",
    )
    if c.rollout.max_model_len is not None:
        _require(c.rollout.max_model_len >= 1, "rollout.max_model_len must be at least 1")
    _require(c.run.poll_interval > 0, "run.poll_interval must be positive")
    _require(c.run.claim_wait >= 0, "run.claim_wait cannot be negative")
    for key, amount in [
        ("ray.rollout_cpus", c.ray.rollout_cpus),
        ("ray.rollout_gpus", c.ray.rollout_gpus),
        ("ray.trainer_cpus", c.ray.trainer_cpus),
        ("ray.trainer_gpus", c.ray.trainer_gpus),
        ("ray.worker_cpus", c.ray.worker_cpus),
        ("ray.max_restarts", c.ray.max_restarts),
    ]:
        _require(amount >= 0, f"{key} cannot be negative")
    _require(c.ray.start_timeout > 0, "ray.start_timeout must be positive")
    _validate_reward_and_algorithm(c)
    if c.agent.enabled:
        _validate_agent(c)
    _validate_weights(c)
    if c.rollout.sleep_while_training:
        _validate_sleep(c)
    for key, device in [("rollout.device", c.rollout.device), ("trainer.device", c.trainer.device)]:
        # Under Ray the engines run on other nodes, which check their own devices as they start.
        check_device(key, device, here=c.launcher == "local")
    if c.model.lora is not None:
        _validate_lora(c)
    if c.model.path is not None:
        _require(Path(c.model.path).is_dir(), f"model.path {c.model.path!r} is not a directory")
    if c.data.max_prompt_length is not None:
        _require(
            c.data.max_prompt_length >= 1,
            f"data.max_prompt_length must be at least 1, not {c.data.max_prompt_length}",
        )
        # A trajectory's response is bounded by agent.max_tokens, each of its turns by
        # rollout.max_tokens.
        response, most = (
            ("agent.max_tokens", c.agent.max_tokens)
            if c.agent.enabled
            else ("rollout.max_tokens", c.rollout.max_tokens)
        )
        longest = c.data.max_prompt_length + most
        _require(
            longest <= c.trainer.micro_batch_tokens,
            f"trainer.micro_batch_tokens ({c.trainer.micro_batch_tokens}) must hold one sample: "
            f"data.max_prompt_length + {response} = {longest}",
        )
    if c.data.task == "addition-longtail":
        _require(c.data.digits >= 3, "data.task: addition-longtail needs data.digits of at least 3")
        _require(
            c.reward.fn != "exact_match",
            "data.task: addition-longtail answers with a scratchpad and '#### <sum>': set "
            "reward.fn: gsm8k (exact_match would score every response 0)",
        )
    if c.data.task in ("arithmetic", "addition-longtail", "multiply-tools"):  # (no files)
        for key, file in [
            ("data.train_file", c.data.train_file),
            ("data.eval_file", c.data.eval_file),
        ]:
            _require(
                file is None,
                f"{key} is read only by a task of files (data.task: dataset or parquet); the "
                f"built-in task {c.data.task!r} generates its problems",
            )
    else:
        task = c.data.task
        _require(c.data.train_file is not None, f"data.task: {task} needs data.train_file")
        for key, file in [
            ("data.train_file", c.data.train_file),
            ("data.eval_file", c.data.eval_file),
        ]:
            if file is not None:
                _require(Path(file).exists(), f"{key} {file!r} does not exist")


#: Train engines that train LoRA adapters.
LORA_ENGINES = ("auto", "hf", "deepspeed", "fsdp")


def _validate_lora(c: Config) -> None:
    lora = c.model.lora
    assert lora is not None
    _require(lora.rank >= 1, f"model.lora.rank must be at least 1, not {lora.rank}")
    _require(lora.alpha > 0, f"model.lora.alpha must be positive, not {lora.alpha}")
    _require(0 <= lora.dropout < 1, f"model.lora.dropout must be in [0, 1), not {lora.dropout}")
    _require(
        bool(lora.target_modules),
        "model.lora.target_modules must name at least one module (e.g. [q_proj, v_proj])",
    )
    for name in lora.target_modules:
        _require(
            bool(name.strip()) and name == name.strip(),
            f"model.lora.target_modules has an empty or padded name {name!r}",
        )
    _require(
        len(set(lora.target_modules)) == len(lora.target_modules),
        "model.lora.target_modules names a module twice",
    )
    _require(
        c.trainer.engine in LORA_ENGINES,
        f"model.lora is supported by the train engines {', '.join(LORA_ENGINES[1:])}, "
        f"not {c.trainer.engine!r}",
    )


#: The devices an hf engine may be placed on.
DEVICE_PATTERN = re.compile(r"cpu|cuda(?::(\d+))?")


def check_device(key: str, device: str, here: bool = True) -> None:
    """Refuses a ``device`` option (named ``key``) that is not ``cpu``, ``cuda`` or ``cuda:N``;
    with ``here``, also a CUDA device this machine does not have."""
    match = DEVICE_PATTERN.fullmatch(device)
    _require(match is not None, f"{key} must be cpu, cuda or cuda:N, not {device!r}")
    if device == "cpu" or not here:
        return
    # Only a GPU setting pays for importing torch here; the CPU default never does.
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        raise ConfigError(
            f"{key} is {device!r} but CUDA is not available on this machine (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda or 'none'}); set {key}=cpu "
            "or run on a machine with a CUDA GPU"
        )
    assert match is not None
    count = torch.cuda.device_count()
    index = int(match.group(1) or 0)
    _require(
        index < count,
        f"{key} is {device!r} but this machine has {count} CUDA device(s) (cuda:0 to "
        f"cuda:{count - 1})",
    )


def _validate_sleep(c: Config) -> None:
    """``rollout.sleep_while_training``: the engines sleep only while nothing can generate."""
    key = "rollout.sleep_while_training"
    _require(
        c.rollout.engine == "vllm",
        f"{key} needs rollout.engine: vllm (the engine that can free its GPU memory and take it "
        f"back), not {c.rollout.engine!r}",
    )
    _require(
        c.trainer.max_staleness == 0,
        f"{key} needs the synchronous mode, trainer.max_staleness: 0: with max_staleness "
        f"{c.trainer.max_staleness} the engines generate later steps' samples while the trainer "
        "steps, so there is no time for them to sleep",
    )
    _require(
        c.trainer.staleness_policy == "wait",
        f"{key} needs trainer.staleness_policy: wait: under drop the engines never wait for the "
        "new weights, so they generate while the trainer steps",
    )
    _require(
        not c.trainer.streaming,
        f"{key} needs trainer.streaming: false: a streaming trainer trains on a step's first "
        "samples while the engines are still generating the rest",
    )
    _require(
        c.rollout.partial == "off",
        f"{key} cannot be combined with rollout.partial: {c.rollout.partial} (its sequences stay "
        "in flight across weight updates, and sleeping discards their KV cache)",
    )
    _require(
        c.launcher == "local",
        f"{key} needs launcher: local: the trainer puts the engines of its own process to "
        "sleep; under Ray they run in actors of their own",
    )
    # Only this setting pays for importing torch here; the engine checks again where it starts.
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        raise ConfigError(no_sleep_mode_here(f"torch {torch.__version__} sees no CUDA device"))


def no_sleep_mode_here(why: str) -> str:
    """The refusal of ``rollout.sleep_while_training`` where vLLM cannot run on CUDA."""
    return (
        f"rollout.sleep_while_training needs vLLM on a CUDA GPU, and here {why}: vLLM's CPU "
        "build has no sleep mode (it refuses enable_sleep_mode, 'Sleep mode is not supported "
        "on current platform', and its CPU worker's sleep only logs a warning); turn the "
        "option off, or run on a GPU machine with vLLM's CUDA build"
    )


#: What an engine of ``auto`` is, when its package is installed; else ``hf``.
_PREFERRED_ENGINES = {"rollout": ("vllm", "vllm"), "train": ("deepspeed", "deepspeed")}


def resolve_engine_name(kind: str, name: str) -> str:
    """``auto`` -> the preferred engine of ``kind`` when installed, else ``hf``."""
    if name != "auto":
        return name
    preferred, module = _PREFERRED_ENGINES[kind]
    return preferred if importlib.util.find_spec(module) is not None else "hf"


def trainer_in_job_process(c: Config) -> bool:
    """Whether the local job's trainer runs in the job's own process: one rank whose versions go
    through the store, not put in a process of its own by ``trainer.own_process``. Several
    ranks, or a transport that sends each version from a trainer process to the job's
    (``broadcast``, ``ipc``), put the trainer's ranks in processes of their own."""
    if c.trainer.dp_size != 1 or c.weights.transport != "store":
        return False
    own = c.trainer.own_process
    if own == "auto":
        own = not _replaces_groups(c.algorithm) and (
            resolve_engine_name("rollout", c.rollout.engine) == "vllm"
        )
    return not own


def _replaces_groups(a: AlgorithmConfig) -> bool:
    """Whether groups that ``filter_groups`` leaves out are generated again in their place."""
    return a.filter_groups and a.max_extra_groups > 0


def _validate_weights(c: Config) -> None:
    w = c.weights
    # Refused rather than silently run as store: see docs/weights.md for what each needs.
    if w.transport != "store":
        _require(
            c.launcher == "local",
            f"weights.transport {w.transport} needs launcher: local: under Ray the rollout "
            "engines run in actors of their own, which do not join the weight-sync group; use "
            "store",
        )
    if w.transport == "ipc":
        # Only this setting pays for importing torch here.
        import torch  # noqa: PLC0415

        _require(
            torch.cuda.is_available(),
            f"weights.transport ipc shares the trainer's GPU memory with the rollout engines "
            f"through CUDA IPC, and torch {torch.__version__} sees no CUDA device here; use "
            "store, or broadcast",
        )
    bucket = _size("weights.bucket_size", w.bucket_size) or 0
    _require(bucket > 0, "weights.bucket_size must be a positive size such as 64MiB")
    _require(w.timeout > 0, "weights.timeout must be positive")


def _validate_agent(c: Config) -> None:
    a = c.agent
    _require(a.max_turns >= 1, "agent.max_turns must be at least 1")
    _require(a.max_tokens >= 1, "agent.max_tokens must be at least 1")
    _require(a.tool_timeout > 0, "agent.tool_timeout must be positive")
    _require(
        "{observation}" in a.observation_template,
        "agent.observation_template must contain {observation}",
    )
    try:  # as the agent loop reads it: the text on each side of the observation
        for side in a.observation_template.split("{observation}", 1):
            side.format()
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(
            f"agent.observation_template: {e!r} in {a.observation_template!r}; it holds "
            "{observation} once, and any other brace doubled ({{ or }})"
        ) from None
    _require(a.latency.median >= 0 and a.latency.sigma >= 0, "agent.latency cannot be negative")
    s = a.sandbox
    _require(
        min(s.cpu_seconds, s.wall_seconds, s.output_bytes, s.processes) > 0,
        "agent.sandbox limits must be positive",
    )
    for key in ("memory", "disk"):
        size = _size(f"agent.sandbox.{key}", getattr(s, key)) or 0
        _require(size > 0, f"agent.sandbox.{key} must be a positive size")
    _require(
        (c.reward.sources or [c.reward.type]) == ["fn"],
        "agent.enabled scores trajectories with reward.fn (and the environment's rewards) only: "
        "reward.type / reward.sources model and http are not applied to them",
    )
    # The environment, parser and tool names are checked by the agents package, which owns their
    # registries, when a run starts (``asyncflow.agents.loop.check_names``): this module stays
    # below everything that reads a configuration.


def _validate_reward_and_algorithm(c: Config) -> None:
    r, a = c.reward, c.algorithm
    sources = r.sources or [r.type]
    _require(len(set(sources)) == len(sources), "reward.sources names a source twice")
    _require(
        not r.weights or len(r.weights) == len(sources),
        f"reward.weights has {len(r.weights)} weights for {len(sources)} sources",
    )
    _require(r.concurrency >= 1, "reward.concurrency must be at least 1")
    if "model" in sources:
        _require(r.model.path is not None, "reward type model needs reward.model.path")
        _require(
            Path(str(r.model.path)).is_dir(),
            f"reward.model.path {r.model.path!r} is not a directory",
        )
        _require(r.model.batch_size >= 1, "reward.model.batch_size must be at least 1")
        _require(r.model.label >= 0, "reward.model.label cannot be negative")
        _require(
            "{response}" in r.model.template,
            f"reward.model.template must contain {{response}}: {r.model.template!r}",
        )
    if "http" in sources:
        url = r.http.url or ""
        _require(
            url.startswith(("http://", "https://")),
            f"reward type http needs reward.http.url (http:// or https://), not {r.http.url!r}",
        )
        _require(r.http.concurrency >= 1, "reward.http.concurrency must be at least 1")
        _require(r.http.timeout > 0, "reward.http.timeout must be positive")
        _require(r.http.retries >= 0, "reward.http.retries cannot be negative")
        _require(r.http.backoff >= 0, "reward.http.backoff cannot be negative")
        _require(
            "{response}" in r.http.template,
            f"reward.http.template must contain {{response}}: {r.http.template!r}",
        )
        try:
            groups = re.compile(r.http.score_pattern).groups
        except re.error as e:
            raise ConfigError(
                f"reward.http.score_pattern is not a regular expression: {e}"
            ) from None
        _require(groups >= 1, "reward.http.score_pattern needs a capture group for the score")
    for key, clip in [("algorithm.clip_low", a.clip_low), ("algorithm.clip_high", a.clip_high)]:
        if clip is not None:
            _require(clip > 0, f"{key} must be positive")
    if a.clip_low is not None:
        _require(a.clip_low < 1, "algorithm.clip_low must be below 1 (the ratio stays positive)")
    _require(a.max_extra_groups >= 0, "algorithm.max_extra_groups cannot be negative")
    _require(
        a.filter_groups or a.max_extra_groups == 0,
        "algorithm.max_extra_groups > 0 replaces groups that algorithm.filter_groups leaves "
        "out: it needs filter_groups: true",
    )
    if _replaces_groups(a):
        _require(
            c.launcher == "local"
            and trainer_in_job_process(c)
            and c.trainer.staleness_policy == "drop",
            "algorithm.max_extra_groups > 0 (replacing left-out groups) needs launcher local, "
            "trainer.dp_size 1, weights.transport store, trainer.own_process false or auto, and "
            "trainer.staleness_policy drop",
        )
    _require(a.overlong_buffer >= 1, "algorithm.overlong_buffer must be at least 1")
    _require(a.overlong_penalty >= 0, "algorithm.overlong_penalty cannot be negative")
    if a.overlong == "penalty":
        # A trajectory's length bound is its budget; a single response's, the turn's.
        key, bound = (
            ("agent.max_tokens", c.agent.max_tokens)
            if c.agent.enabled
            else ("rollout.max_tokens", c.rollout.max_tokens)
        )
        _require(a.overlong_buffer <= bound, f"algorithm.overlong_buffer cannot exceed {key}")
    if a.advantage == "reinforce++" and c.trainer.kl_coef > 0:
        _require(a.reference, "algorithm.advantage reinforce++ with kl_coef needs reference")
    if a.advantage == "gae":
        _validate_critic(c)


def _validate_critic(c: Config) -> None:
    a, k = c.algorithm, c.critic
    _require(0 <= a.gamma <= 1, "algorithm.gamma must be in [0, 1]")
    _require(0 <= a.lam <= 1, "algorithm.lam must be in [0, 1]")
    _require(k.value_clip > 0, "critic.value_clip must be positive")
    _require(k.lr is None or k.lr > 0, "critic.lr must be positive")
    _require(
        c.launcher == "local",
        "algorithm.advantage gae (the critic worker) runs with launcher local only",
    )
    if k.path is not None:
        _require(Path(k.path).is_dir(), f"critic.path {k.path!r} is not a directory")
