"""A claimed micro-batch: the rows one claim leased to one task, and what to do with them."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncflow.columns import pad
from asyncflow.errors import BadRequestError, LeaseError, UnknownIndexError

if TYPE_CHECKING:
    import torch

    from asyncflow._native import ClaimedCells
    from asyncflow.store import Store

#: Seconds before its lease's end that cells sent with a claim stop being read locally: the
#: lease's end is measured by the daemon, a little before the claim's reply arrives.
CELLS_MARGIN = 0.05


class Batch:
    """Rows leased to one task by one claim.

    Use it as a context manager to ack on success and hand the rows back (for immediate
    redelivery) if the body raises::

        with store.claim("train", ["input_ids", "adv"], 64) as batch:
            train_on(batch.to_torch())
    """

    __slots__ = (
        "_acked",
        "_cells",
        "_cells_until",
        "_unsettled",
        "expires_in",
        "fields",
        "groups",
        "indexes",
        "lease",
        "store",
        "task",
        "versions",
    )

    def __init__(
        self,
        store: Store,
        task: str,
        fields: tuple[str, ...],
        lease: int | None,
        indexes: np.ndarray,
        versions: np.ndarray,
        groups: np.ndarray,
        expires_in: float | None,
        cells: ClaimedCells | None = None,
    ) -> None:
        self.store = store
        self.task = task
        self.fields = fields
        #: Lease id, or None for an empty batch (nothing to ack).
        self.lease = lease
        #: Global row indexes (uint64), oldest first.
        self.indexes = indexes
        #: Policy version that produced each row (uint64).
        self.versions = versions
        #: GRPO group of each row (int64; -1 for rows outside any group).
        self.groups = groups
        #: Seconds the lease had left when the claim returned.
        self.expires_in = expires_in
        self._unsettled = len(indexes) if lease is not None else 0
        # Rows this batch acked (None: all of them), to say so when they are read afterwards.
        self._acked: set[int] | None = set()
        # The claimed fields' cells, when a daemon on this machine sent them with the claim:
        # read without asking it again while the lease certainly holds them.
        self._cells = cells
        self._cells_until = self._lease_end(expires_in)

    def __len__(self) -> int:
        return len(self.indexes)

    def __repr__(self) -> str:
        return f"Batch(task={self.task!r}, rows={len(self)}, lease={self.lease})"

    def read(self, fields: Sequence[str] | None = None) -> dict[str, list[Any]]:
        """``{field: [value per row]}`` — read-only NumPy views into store memory (no copy; they
        keep the payload alive while referenced), or ``bytes`` for bytes fields. Defaults to the
        claimed fields. Raises ``LeaseError`` if the rows are gone because the lease ended.

        From a daemon on this machine the claimed fields' cells came with the claim, and the
        batch keeps them until it is acked or released: reading them asks the daemon nothing."""
        if len(self) == 0:
            return {f: [] for f in fields or self.fields}
        names = list(fields or self.fields)
        if self._cells is not None and time.monotonic() < self._cells_until:
            sent = self._cells.read(names)
            if sent is not None:
                return sent
        try:
            return self.store.read(self.indexes, names)
        except UnknownIndexError as e:
            if self.lease is None:
                raise
            if self._acked is None or self._acked.intersection(self.indexes.tolist()):
                raise LeaseError(
                    f"rows of lease {self.lease} are gone ({e}): this batch acked them, and an "
                    "ack commits rows and frees those every task has acked; read before acking"
                ) from e
            # A live lease keeps its rows: they can only be gone once it has ended.
            raise LeaseError(
                f"rows of lease {self.lease} are gone ({e}): the lease ended (it expired, or the "
                "daemon restarted) and another holder committed them, or their partition was "
                "cleared"
            ) from e

    def lengths(self, field: str) -> np.ndarray:
        """First-dimension length of ``field`` on each row."""
        return np.array([len(v) for v in self.read([field])[field]], dtype=np.int64)

    def to_torch(
        self, pad_value: float = 0, fields: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """``{field: tensor}``, rows stacked on the first axis and ragged rows right-padded with
        ``pad_value`` (this copies). bf16 fields come back as ``torch.bfloat16``. By default all
        claimed numeric fields; naming a bytes field raises ``BadRequestError``."""
        import torch  # noqa: PLC0415 - store clients without tensors never pay torch's import

        out: dict[str, torch.Tensor] = {}
        for name, values in self.read(fields).items():
            if values and isinstance(values[0], bytes):
                if fields is None:
                    continue
                raise BadRequestError(f"field {name!r} holds bytes; read() it instead")
            if values and values[0].dtype == np.uint16:  # the store's bfloat16, as its bits
                bits = torch.tensor(pad_value, dtype=torch.bfloat16).view(torch.int16).item()
                stacked = pad(values, np.int16(bits).view(np.uint16))
                out[name] = torch.from_numpy(stacked.view(np.int16)).view(torch.bfloat16)
            else:
                out[name] = torch.from_numpy(pad(values, pad_value))
        return out

    def ack(self, indexes: Sequence[int] | np.ndarray | None = None) -> None:
        """Commits the rows (or ``indexes`` of them) for this task."""
        self.store.ack(self, indexes)

    def release(self, indexes: Sequence[int] | np.ndarray | None = None) -> None:
        """Hands the rows (or ``indexes`` of them) back for immediate redelivery."""
        self.store.release(self, indexes)

    def renew(self, timeout: float | None = None) -> float:
        """Extends the lease; returns the seconds it now has left."""
        left = self.store.renew(self, timeout)
        self._cells_until = self._lease_end(left)
        return left

    @staticmethod
    def _lease_end(expires_in: float | None) -> float:
        return math.inf if expires_in is None else time.monotonic() + expires_in - CELLS_MARGIN

    def _drop_cells(self) -> None:
        """Lets go of the cells sent with the claim. Done before an ack or release is sent, so
        that the daemon hears first that they are no longer viewed and can reuse their memory
        as soon as the rows are freed."""
        self._cells = None

    def _note_acked(self, indexes: np.ndarray | None) -> None:
        """Records that this batch acked ``indexes`` (None: all its rows)."""
        if indexes is None or self._acked is None:
            self._acked = None
        else:
            self._acked.update(indexes.tolist())

    def _settle(self, rows: int | None) -> None:
        """Records that ``rows`` (None: all remaining) were acked or released."""
        self._unsettled = 0 if rows is None else max(0, self._unsettled - rows)

    def __enter__(self) -> Batch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._unsettled == 0:
            return
        if exc_type is None:
            self.ack()
        else:
            self.release()
