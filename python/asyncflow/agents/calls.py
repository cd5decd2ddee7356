"""Calling a user's function from the agent loop's event loop: an ``async def`` one is awaited,
a plain one runs in a daemon thread of its own, so a slow or hung one blocks no other trajectory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any


async def call(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, awaited if it is a coroutine function; a plain one runs in a
    thread (and what it returns is awaited if it is awaitable). A ``SystemExit`` or
    ``KeyboardInterrupt`` it raises comes back as a ``RuntimeError`` (see :func:`exiting`)."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        result = await in_thread(functools.partial(fn, *args, **kwargs))
        return await result if inspect.isawaitable(result) else result
    except (SystemExit, KeyboardInterrupt) as e:
        raise exiting(e) from None


def exiting(e: BaseException) -> RuntimeError:
    """What a user's function that raised ``SystemExit`` or ``KeyboardInterrupt`` (a tool built
    on argparse or click exits on bad arguments) raises instead: raised in a task, either would
    end the whole event loop, every other trajectory with it."""
    return RuntimeError(f"{type(e).__name__}: {e}")


async def in_thread(fn: Callable[..., Any], /, *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread of its own. Unlike ``asyncio.to_thread`` it takes no
    thread of the loop's shared pool, and the loop's end does not wait for it: a call that hangs,
    given up by its caller's timeout, costs one idle thread and nothing else."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # given up already
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def work() -> None:
        error: BaseException | None
        try:
            result, error = fn(*args), None
        except StopIteration as e:  # a future refuses it (PEP 479): it would never settle
            result, error = None, RuntimeError(f"raised StopIteration: {e}")
        except (SystemExit, KeyboardInterrupt) as e:
            result, error = None, exiting(e)
        except BaseException as e:
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name="agent-call", daemon=True).start()
    return await future
