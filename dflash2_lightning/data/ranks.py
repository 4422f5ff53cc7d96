"""The ranks of a distributed job taking one step together: each runs its part, then all learn who failed.

:meth:`Ranks.agree` runs a function on every rank and then exchanges, over a gloo group, whether it raised
and with what message. Rank 0 raises the first failure (its own exception, or one with the failed rank's
message); for a user error every other rank raises
:class:`~dflash2_lightning.errors.ReportedByAnotherRank`, which exits with status 2 without printing, so the
user reads one ``dflash2: error:`` line; a bug raises its own exception (and traceback) on the rank that hit
it. So one rank's failure stops every rank at the next exchange, and no rank is left waiting in a collective
for a peer that has already given up.

Why a gloo group of its own: the exchange then runs on the CPU whatever the training backend is (NCCL would
synchronise the GPU stream at every exchange, ending the overlap of the copies and writes with the next
batch), and it gets a long timeout: one rank may legitimately work alone for hours (hashing a terabyte cache)
while the others wait. A peer that dies outright closes its sockets, which gloo reports at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from dflash2_lightning.errors import ReportedByAnotherRank, UserError
from dflash2_lightning.reporting import describe, find_user_error

T = TypeVar("T")
#: how long a rank waits at an exchange for a live peer that is still working (a dead one is noticed at once)
EXCHANGE_TIMEOUT = timedelta(days=7)


class PeerFailedError(UserError):
    """Another rank failed with a user error: what rank 0 raises, with that rank's own message."""


@dataclass(frozen=True)
class Failure:
    """What one rank reports of an exception: its rank, the exception's type, message, and whether it is
    a user error (a bad input, a full disk) rather than a bug."""

    rank: int
    kind: str
    message: str
    user: bool

    @classmethod
    def of(cls, rank: int, error: BaseException) -> Failure:
        cause = find_user_error(error)
        if cause is not None:
            return cls(rank, type(cause).__name__, describe(cause), True)
        return cls(rank, type(error).__name__, str(error).splitlines()[0] if str(error) else "", False)

    def exception(self) -> Exception:
        """The exception a peer raises for this failure."""
        if self.user:
            return PeerFailedError(self.message)
        return RuntimeError(
            f"rank {self.rank} failed while building the offline feature cache "
            f"({self.kind}: {self.message}); see that rank's traceback"
        )


class Ranks:
    """This process's place in the job (``rank`` of ``world``) and the exchange of failures between ranks.

    Outside a ``torch.distributed`` job (or in one of a single process) it is rank 0 of 1 and
    :meth:`agree` just calls the function.
    """

    def __init__(self) -> None:
        self.group: Any = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            # new_group is itself collective: every rank constructs Ranks at the same point.
            self.group = dist.new_group(backend="gloo", timeout=EXCHANGE_TIMEOUT)
        else:
            self.rank, self.world = 0, 1

    def agree(self, step: Callable[[], T], share: bool = False) -> T:
        """Run ``step`` here, then exchange failures with every rank; raise if any rank failed.

        ``share``: return rank 0's result on every rank (it must pickle); otherwise this rank's own.
        """
        error: BaseException | None = None
        result: Any = None
        try:
            result = step()
        except Exception as e:  # reported to the peers first, raised below
            error = e
        if self.world == 1:
            if error is not None:
                raise error
            return result
        mine = (
            Failure.of(self.rank, error) if error is not None else None,
            result if share and self.rank == 0 and error is None else None,
        )
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, mine, group=self.group)
        failures = [f for f, _ in gathered if f is not None]
        if failures and failures[0].user and self.rank != 0:  # rank 0 reports it: the user reads it once
            raise ReportedByAnotherRank(failures[0].message) from error
        if error is not None:
            raise error
        if failures:
            raise failures[0].exception()
        return gathered[0][1] if share else result

    def close(self) -> None:
        """Release the exchange's process group (collective: every rank calls it)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
