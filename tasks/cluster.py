"""Where the flow's shard tasks run: the flow's own task runner (threads of its process; each shard is a
subprocess of this machine), or the workers of the Dask cluster at `run.dask_address`, through
prefect-dask's `DaskTaskRunner` (`pip install -e '.[dask]'`; README "Scale out").

The address is tried once when the flow starts, before any stage runs: an unreachable scheduler
fails the flow in seconds, naming the key and the address, with nothing written. (prefect-dask
itself connects only at the first shard task, after the training stages, and waits 30 s.)
"""
from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.task_runners import TaskRunner

from stages.harness.config import DASK_ADDRESS, Params

KEY = "run.dask_address"
CONNECT_TIMEOUT_S = 5.0


class ClusterUnreachable(ConnectionError):
    """No Dask scheduler answers at `run.dask_address`."""


@contextmanager
def shard_runner(params: Params) -> Iterator[TaskRunner | None]:
    """The Dask task runner of `run.dask_address`, checked reachable; None (the flow's own runner) when null."""
    address = params.run.dask_address
    if not address:
        yield None
        return
    try:
        from prefect_dask import DaskTaskRunner  # the [dask] extra: needed only when an address is set
    except ImportError as e:
        raise ImportError(f"{KEY} = {address!r} needs prefect-dask ({e}): pip install -e '.[dask]', or set "
                          f"{KEY}: null; nothing was run or written") from None
    check_reachable(address)
    with DaskTaskRunner(address=address) as runner:  # connects at its first task
        yield runner


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Open and close a TCP connection to the scheduler at `address`, or raise ClusterUnreachable naming it."""
    m = DASK_ADDRESS.fullmatch(address)
    if m is None:  # the params check refuses such an address first
        raise ValueError(f"{KEY} = {address!r}: expected host:port, optionally after tcp:// or tls://")
    host, port = m["host"].strip("[]"), int(m["port"])
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise ClusterUnreachable(
            f"{KEY} = {address!r}: no Dask scheduler answers there ({e.strerror or e}); start one "
            f"(`dask scheduler`, then `dask worker {address}` on each machine) or fix the address, or set "
            f"{KEY}: null to run the shards on this machine; nothing was run or written") from None
