"""The emulated engine of partial rollout (pipeline emulation): each stored token carries the
version that sampled the modelled token it stands for, across loads (continue) and cuts (abort).
A hand-stepped device stands in for the real-time one, so nothing depends on the clock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from asyncflow.bench import costs as cost_model
from asyncflow.bench.emulation.devices import DecodeDevice, _Call, _Sequence
from asyncflow.bench.emulation.engines import EmulatedPartialRollout, response_lengths
from asyncflow.engines.base import Request, Sampling

PROMPT = [2, 3, 4]


class HandDevice:
    """Decodes only when told to, every sequence in step."""

    def __init__(self) -> None:
        self.sequences: list[_Sequence] = []
        self.prefills: list[int] = []

    def start(self, length: int, prompt_tokens: int, on_done: Callable[[], None]) -> _Sequence:
        seq = _Sequence(length, prompt_tokens, _Call(1, on_done=on_done))
        self.sequences.append(seq)
        self.prefills.append(prompt_tokens)
        return seq

    def decode(self, steps: int) -> None:
        for seq in self.sequences:
            seq.remaining = max(0, seq.remaining - steps)
            if seq.remaining == 0 and not seq.call.done.is_set():
                seq.call.done.set()
                assert seq.call.on_done is not None
                seq.call.on_done()

    def cut(self, sequences: list[_Sequence]) -> list[_Sequence]:
        found = [s for s in self.sequences if s in sequences and not s.call.done.is_set()]
        self.sequences = [s for s in self.sequences if s not in sequences]
        return found

    def pause(self, seconds: float) -> None:
        pass


def engine() -> tuple[EmulatedPartialRollout, HandDevice, cost_model.CostModel]:
    costs = cost_model.load(None)
    costs = replace(costs, emulation=replace(costs.emulation, compression=10))
    device = HandDevice()
    e = EmulatedPartialRollout(device, costs, 0.0, 0.0)  # type: ignore[arg-type]
    return e, device, costs


def test_continue_tags_tokens_after_the_load_with_the_new_version() -> None:
    e, device, costs = engine()
    length = response_lengths(PROMPT, costs.workload.group_size, costs)[0]
    e.add_request(Request((0, 0), PROMPT, Sampling()))
    device.decode(length // 2)
    e.load_weights(1, [])
    device.decode(length)
    (done,) = e.step()
    stored = -(-length // 10)
    # Stored token i stands for modelled token 10 i: those before the load's point are version 0.
    before = -(-(length // 2) // 10)
    assert len(done.token_ids) == stored
    assert done.versions == [0] * before + [1] * (stored - before)


def test_abort_keeps_the_prefix_and_prefills_it_again_under_the_new_version() -> None:
    e, device, costs = engine()
    length = response_lengths(PROMPT, costs.workload.group_size, costs)[0]
    e.add_request(Request((0, 0), PROMPT, Sampling()))
    device.decode(length // 2)
    (cut,) = e.abort_requests()
    kept = len(cut.token_ids)
    assert kept == (length // 2) // 10 and set(cut.versions) == {0}
    e.load_weights(1, [])
    e.add_request(cut)
    # Every modelled token decoded before the cut is prefilled, not decoded again.
    assert device.prefills[-1] == costs.workload.prompt_tokens + length // 2
    assert device.sequences[-1].remaining == length - length // 2
    device.decode(length)
    (done,) = e.step()
    before = -(-(length // 2) // 10)  # stored tokens standing for modelled ones before the cut
    assert done.versions == [0] * before + [1] * (len(done.token_ids) - before)
    assert len(done.token_ids) == -(-length // 10)


def test_a_sequence_that_ended_before_the_abort_is_not_cut_but_returned_whole() -> None:
    e, device, costs = engine()
    length = response_lengths(PROMPT, costs.workload.group_size, costs)[0]
    e.add_request(Request((0, 0), PROMPT, Sampling()))
    device.decode(length)  # ended under version 0, not yet collected by step()
    assert e.abort_requests() == []
    e.load_weights(1, [])
    (done,) = e.step()
    assert done.versions == [0] * -(-length // 10)
    assert device.prefills == [costs.workload.prompt_tokens], "no second prefill"


def test_the_hand_device_has_the_real_ones_interface() -> None:
    for name in ("start", "cut", "pause"):
        assert callable(getattr(DecodeDevice, name))
