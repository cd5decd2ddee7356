"""The process of one data-parallel trainer rank.

Start-up order: send output to the rank's log file; join the process group (before anything else can
create one); build the train engine (DeepSpeed or FSDP2); connect to the store daemon; rank 0 joins
the weight-sync group as its publisher (``weights.transport: broadcast`` or ``ipc``: the job's
process joins as the receiver) and publishes the initial weights; report ready. Then it serves the
job's commands, one at a time, until told to close or until the job's end of the pipe closes.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from asyncflow.config import Config, resolve_engine_name
from asyncflow.daemon import connect, end_with_parent
from asyncflow.engines.base import TrainEngine
from asyncflow.engines.process_group import Rendezvous
from asyncflow.engines.registry import create_train_engine
from asyncflow.errors import ConfigError
from asyncflow.models.tokenizer import load_tokenizer
from asyncflow.store import Store
from asyncflow.units import parse_size
from asyncflow.weight_sync import Publisher
from asyncflow.weight_sync.broadcast import BroadcastPublisher
from asyncflow.weight_sync.group import Group, GroupSpec
from asyncflow.weight_sync.ipc import IpcPublisher
from asyncflow.weight_sync.store_transport import StorePublisher
from asyncflow.workers.rank_step import RankStep

#: The train engines that run as data-parallel ranks, one process each.
RANK_ENGINES = ("deepspeed", "fsdp")


def check_rank_engine(config: Config, train_name: str) -> None:
    """Refuses data-parallel ranks of an engine that cannot run as one (either launcher; checked
    when a run starts)."""
    if config.trainer.dp_size > 1 and train_name not in RANK_ENGINES:
        raise ConfigError(
            f"trainer.dp_size > 1 needs trainer.engine {' or '.join(RANK_ENGINES)}, "
            f"not {train_name!r}"
        )


@dataclass(frozen=True)
class RankSpec:
    rank: int
    world_size: int
    master_port: int
    model_dir: Path
    config: Config
    store_address: str
    store_token: str | None
    log_path: Path
    #: Where rank 0 listens for its peers (another machine's address under Ray).
    master_addr: str = "127.0.0.1"
    #: The weight-sync group rank 0 publishes over (``weights.transport: broadcast`` or
    #: ``ipc``); None: rank 0 publishes through the store.
    weight_sync: GroupSpec | None = None
    #: Rank 0's socket listening on ``master_port`` since the port was chosen (see
    #: ``process_group.listening``); None: rank 0 binds the port when it joins.
    listener: socket.socket | None = None
    #: The job's process, when it started the rank's: the rank ends with it (a job killed
    #: outright left its ranks running for another half minute, until their waits ran out).
    parent: int | None = None


def describe(error: BaseException) -> str:
    """An error and where it happened, for the job's message (the log has the rest)."""
    where = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    place = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
    return f"{type(error).__name__}: {error}{place}"


def _log_to(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(spec: RankSpec, conn: Connection) -> None:
    """Entry point of the rank's process."""
    if spec.parent is not None and not end_with_parent(spec.parent):
        return
    _log_to(spec.log_path)
    try:
        handlers = start(spec)
    except BaseException as e:
        traceback.print_exc()
        conn.send(("error", describe(e)))
        return
    conn.send(("ok", handlers["version"](None)))
    while True:
        try:
            command, argument = conn.recv()
        except (EOFError, OSError):
            return  # the job is gone
        try:
            conn.send(("ok", handlers[command](argument)))
        except BaseException as e:
            traceback.print_exc()
            conn.send(("error", describe(e)))
        if command == "close":
            return


def start(spec: RankSpec) -> dict[str, Callable[[Any], Any]]:
    """Starts the rank (see the module's docstring); its command handlers by name."""
    name = resolve_engine_name("train", spec.config.trainer.engine)
    engine: TrainEngine
    if spec.world_size == 1 and name not in RANK_ENGINES:  # a lone rank may use any engine
        engine = create_train_engine(name, spec.model_dir, spec.config)
    else:
        rendezvous = Rendezvous(
            spec.rank, spec.world_size, spec.master_port, spec.master_addr, spec.listener
        )
        engine = create_train_engine(name, spec.model_dir, spec.config, rendezvous)
    store = connect(spec.store_address, token=spec.store_token)
    pad_id = load_tokenizer(spec.model_dir).pad_id
    publisher = weight_publisher(spec, store)
    step = RankStep(
        store, spec.config, engine, pad_id, spec.rank, spec.world_size, threading.Event(), publisher
    )
    step.publish()
    # After the first publication: an FSDP2 model whose first use is a forward pass without
    # gradients fails its first backward pass later ("Trying to resize storage that is not
    # resizable", torch 2.13); the publication gathers its weights first.
    step.loss.check_sharing(engine)

    def load(directory: Path) -> int:
        engine.load(directory)
        step.publish()
        return engine.version

    def close(_: Any) -> None:
        engine.close()
        publisher.close()

    return {
        "version": lambda _: engine.version,
        "step": step.run,
        "logprobs": engine.logprobs,
        "save": engine.save,
        "load": load,
        "save_pretrained": engine.save_pretrained,
        "close": close,
    }


def weight_publisher(spec: RankSpec, store: Store) -> Publisher:
    """How rank 0 publishes each version: over the weight-sync group, whose rendezvous it serves
    (waiting up to its ``join_timeout`` for the job's process to join), or through the store.
    Other ranks only take part in gathering the weights, and publish nothing."""
    if spec.weight_sync is None or spec.rank != 0:
        return StorePublisher(store)
    group = Group(spec.weight_sync, 0, "trainer rank 0")
    if spec.config.weights.transport == "ipc":
        return IpcPublisher(store, group)  # on the GPU that holds the rank's weights
    bucket = parse_size(spec.config.weights.bucket_size)
    assert bucket is not None  # validated with the config
    return BroadcastPublisher(store, group, bucket)
