"""The store's Python surface stays one surface: the compiled module's signatures are the stub's,
every native store method has its Python wrapper, and the options classes hold exactly the
options (and defaults) the Rust side reads."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import asyncflow as af
from asyncflow import _native

STUB = Path(_native.__file__).with_name("_native.pyi")

#: Native store methods the Python ``Store`` exposes under another name.
WRAPPED_ELSEWHERE = {"connect": af.connect}


def stub_functions() -> Iterator[tuple[str, ast.FunctionDef]]:
    """``(qualified name, definition)`` of every function and method the stub declares."""
    tree = ast.parse(STUB.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield f"{node.name}.{item.name}", item


def stub_parameters(fn: ast.FunctionDef) -> list[tuple[str, str, object]]:
    """``(name, kind, default)`` of each parameter, as ``inspect`` names kinds; the default is
    ``inspect.Parameter.empty`` when there is none and ``...`` when the stub leaves it out."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults))
    defaults += list(a.defaults)
    out: list[tuple[str, str, object]] = []
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append((arg.arg, kind, literal(default)))
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", inspect.Parameter.empty))
    for arg, kw_default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append((arg.arg, "KEYWORD_ONLY", literal(kw_default)))
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", inspect.Parameter.empty))
    return out


def literal(node: ast.expr | None) -> object:
    if node is None:
        return inspect.Parameter.empty
    return ast.literal_eval(node)


def runtime_parameters(obj: Callable[..., Any]) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(obj).parameters.values()]


def runtime_object(qualified: str) -> Callable[..., Any]:
    owner: Any = _native
    for part in qualified.split("."):
        owner = getattr(owner, part)
    return owner  # type: ignore[no-any-return]


def test_the_stub_declares_every_public_name_of_the_module() -> None:
    tree = ast.parse(STUB.read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    annotated = {n.target for n in tree.body if isinstance(n, ast.AnnAssign)}
    declared = defined | {t.id for t in annotated if isinstance(t, ast.Name)}
    public = {n for n in dir(_native) if not n.startswith("_")} | {"__version__"}
    assert public == declared


@pytest.mark.parametrize("qualified", [name for name, _ in stub_functions()])
def test_every_signature_matches_the_stub(qualified: str) -> None:
    stub = dict(stub_functions())[qualified]
    want = stub_parameters(stub)
    if qualified.endswith(".__new__"):
        # A class's signature is its constructor's, without `cls`.
        got = runtime_parameters(runtime_object(qualified.rsplit(".", 1)[0]))
        want = want[1:]
    else:
        got = runtime_parameters(runtime_object(qualified))
        is_method = "." in qualified and not any(
            isinstance(d, ast.Name) and d.id == "staticmethod" for d in stub.decorator_list
        )
        if is_method:
            # PyO3 marks `self` positional-only; the stub leaves it plain.
            assert got[0][0] == "self" and want[0][0] == "self"
            got, want = got[1:], want[1:]
    assert [(n, k) for n, k, _ in got] == [(n, k) for n, k, _ in want]
    for (name, _, ours), (_, _, theirs) in zip(got, want, strict=True):
        if theirs is not Ellipsis:
            assert ours == theirs, f"{qualified}: default of {name}"


def test_every_native_store_method_has_its_python_wrapper() -> None:
    native = {n for n in dir(_native.Store) if not n.startswith("_")}
    wrapped = {n for n in dir(af.Store) if not n.startswith("_") and not n.endswith("_async")}
    assert native - set(WRAPPED_ELSEWHERE) == wrapped
    for name, wrapper in WRAPPED_ELSEWHERE.items():
        ours = set(inspect.signature(wrapper).parameters)
        theirs = set(inspect.signature(getattr(_native.Store, name)).parameters)
        assert theirs <= ours, f"{name}: {theirs - ours} not passed on"


def test_claim_options_are_the_rust_claim_options_with_their_defaults() -> None:
    defaults = _native.claim_defaults()
    fields = {f.name: f.default for f in dataclasses.fields(af.ClaimOptions)}
    assert fields == defaults
    # The Rust side reads exactly these attributes back.
    options = af.ClaimOptions(step=3, dp_size=2, dp_rank=1, cost="attention", equal_count=True)
    assert dataclasses.asdict(options).keys() == defaults.keys()


def test_keyword_arguments_build_or_amend_the_options(make_store: Callable[..., af.Store]) -> None:
    store = make_store(shards=2)
    store.register_task("t")
    first = store.put({"x": [1, 2, 3]}, options=af.PutOptions(partition="a", version=4))
    store.put({"x": [5]}, partition="b")
    base = af.ClaimOptions(partition="b", timeout=5)
    # A keyword replaces the options' field: partition "a", not "b".
    batch = store.claim("t", "x", 3, options=base, partition="a", min_version=4)
    np.testing.assert_array_equal(np.sort(batch.indexes), first)
    assert base.partition == "b", "the options object is frozen and left as it was"
    batch.ack()
    with pytest.raises(af.BadRequestError, match="no_such_option"):
        store.claim("t", "x", 1, no_such_option=True)
    with pytest.raises(af.BadRequestError, match="no_such_option"):
        store.put({"x": [1]}, no_such_option=True)


def test_options_of_the_wrong_type_are_bad_requests(make_store: Callable[..., af.Store]) -> None:
    store = make_store(shards=2)
    store.register_task("t")
    store.put({"x": [1, 2]})
    with pytest.raises(af.BadRequestError):
        store.claim("t", "x", 1, dp_size=-1, step=1)
    with pytest.raises(af.BadRequestError):
        store.claim("t", "x", 1, timeout="soon")
    with pytest.raises(af.BadRequestError, match="need step"):
        store.claim("t", "x", 1, dp_size=2, timeout=1)
    # The cost model is read only with step: without it, asking for one is refused too.
    for cost in [{"cost": "attention"}, {"linear_weight": 5.0}]:
        with pytest.raises(af.BadRequestError, match="need step"):
            store.claim("t", "x", 1, timeout=1, **cost)
    with pytest.raises(af.BadRequestError, match="unknown cost model"):
        store.claim("t", "x", 1, timeout=1, cost="bogus")
    assert store.stats()["active_leases"] == 0


@pytest.mark.parametrize("shards", [0, -1, 2**40])
def test_a_shard_count_out_of_range_is_a_bad_request(shards: int) -> None:
    """Not an abort of the process trying to allocate 2**40 shards."""
    with pytest.raises(af.BadRequestError, match=r"shards|negative"):
        af.Store(shards=shards)


def test_options_objects_are_read_afresh_whatever_was_seen_before(
    make_store: Callable[..., af.Store],
) -> None:
    # More distinct options objects than the native store remembers, each used twice in turn:
    # every claim gets the rows of its own partition.
    store = make_store(shards=2)
    store.register_task("t")
    parts = [f"p{i}" for i in range(12)]
    rows = {p: store.put({"x": [1, 2]}, partition=p) for p in parts}
    for p in parts + parts:
        batch = store.claim("t", "x", 1, options=af.ClaimOptions(partition=p, timeout=5))
        assert int(batch.indexes[0]) in rows[p]
        batch.ack()


def test_equal_keywords_of_another_type_are_not_taken_for_each_other(
    make_store: Callable[..., af.Store],
) -> None:
    store = make_store(shards=2)
    store.register_task("t")
    store.put({"x": [1, 2]})
    store.claim("t", "x", 1, whole_groups=True, timeout=5).release()
    # 1 == True, but a claim option that must be a bool refuses 1 every time.
    with pytest.raises(af.BadRequestError):
        store.claim("t", "x", 1, whole_groups=1, timeout=5)
