"""ringzero as a torch.distributed backend.

Installing this package is enough: torch finds the backend through the
``torch.distributed.backends`` entry point, so ``dist.init_process_group("ringzero")`` works
without importing anything. Importing ``ringzero_torch`` registers it too.

    import torch.distributed as dist
    dist.init_process_group("ringzero")          # instead of "gloo"

Options (``pg_options``): ``ringzero_torch.Options(reproducible=True, algorithm="ring")``; the
``RINGZERO_*`` environment variables of the C++ library apply as well (docs/environment.md).
"""

from __future__ import annotations

import dataclasses
import datetime

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed as dist

from . import _C

__all__ = ["Options", "register", "transport"]


@dataclasses.dataclass
class Options:
    """What ``init_process_group(..., pg_options=Options(...))`` passes to ringzero.

    reproducible: float sums (SUM, AVG) exact and rounded once: the same bits at any world
        size, algorithm or arrival order (ringzero's ``options::reproducible``).
    algorithm: force one of ringzero's algorithms ("ring", "tree", "rd", "rhd", ...); empty
        leaves the choice to ringzero (or to ``RINGZERO_ALGO``).
    """

    reproducible: bool = False
    algorithm: str = ""


def _create(dist_opts, backend_options):
    opts = backend_options if isinstance(backend_options, Options) else Options()
    timeout = dist_opts.timeout
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    return _C.create_backend(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        timeout,
        opts.reproducible,
        opts.algorithm,
    )


def register() -> None:
    """Registers the "ringzero" backend with torch.distributed (idempotent).

    This is the ``torch.distributed.backends`` entry point's registrar: torch calls it with no
    arguments the first time a process group names "ringzero".
    """
    if "RINGZERO" in dist.Backend._plugins:
        return
    dist.Backend.register_backend("ringzero", _create, extended_api=True, devices=["cpu", "cuda"])


def transport(group=None) -> str:
    """The ringzero transport a process group runs over: "shm" (one host) or "socket"."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return _C.transport(pg._get_backend(torch.device("cpu")))


register()
