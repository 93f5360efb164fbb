"""PyTorch's own distributed test suite over the "ringzero" backend.

Runs torch.testing._internal.distributed.distributed_test's DistributedTest._DistTestBase, the
suite torch's test/distributed/test_distributed_spawn.py runs for gloo, with BACKEND=ringzero:

    python tests/torch/distributed_suite.py --world-size 2 [--subset] [unittest -k patterns]

The suite's skip decorators are evaluated while the module is imported, and they name the
backends that have each feature; an out-of-tree backend is in none of those lists, and the tests
choose their CPU paths with `if BACKEND == "gloo"` while they run. So that every test gloo runs on
CPU also runs here, the module is imported as gloo's run would import it, and its BACKEND is then
the name "ringzero" that also compares equal to "gloo": init_process_group gets "ringzero", and
every branch on the name takes gloo's (CPU) path. The tests that still cannot pass on ringzero
are skipped by name in SKIPPED below, each with its reason (docs/torch.md lists them).

--subset runs the fixed subset of the README's test command (collectives, DDP, subgroups).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import unittest

# Read by the suite at import; the runner's arguments set them before importing it.
_parser = argparse.ArgumentParser(add_help=False)
_parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "2")))
_parser.add_argument("--subset", action="store_true")
_parser.add_argument("--list", action="store_true")
_parser.add_argument("--gloo", action="store_true",
                     help="run the suite over gloo itself, as torch's CI does: the reference "
                     "that every CPU test passing there must also pass over ringzero")
_parser.add_argument("--fork", action="store_true",
                     help="start each test's ranks by fork() from this process, which has torch "
                     "imported already, instead of spawning fresh interpreters that import it "
                     "again (what the whole suite's time goes to on a small machine)")
_parser.add_argument("--cpu", action="store_true",
                     help="leave out the tests named for GPUs (cuda, nccl, gpu), which skip "
                     "themselves without one")
_args, _rest = _parser.parse_known_args()
os.environ["WORLD_SIZE"] = str(_args.world_size)
os.environ["BACKEND"] = "gloo"
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="ringzero-torch-suite-"))
# The suite's own knobs for what would need GPUs, torchvision or long sleeps.
os.environ.setdefault("INIT_METHOD", "env://")
# Under CI=true torch's run_tests writes JUnit XML through the xmlrunner package, which torch does
# not depend on; this runner reports through its exit status and output, as the stage reads them.
os.environ.pop("CI", None)

import torch.multiprocessing  # noqa: E402
import torch.testing._internal.distributed.distributed_test as distributed_test  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402
from torch.testing._internal.common_utils import run_tests  # noqa: E402

import ringzero_torch  # noqa: E402,F401  (registers the backend in the spawned ranks as well)

class _BackendName(str):
    """ "ringzero", which the suite's branches on the backend's name also take for "gloo"."""

    def __eq__(self, other):
        return str.__eq__(self, other) or other == "gloo"

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__


if not _args.gloo:
    distributed_test.BACKEND = _BackendName("ringzero")
    for feature in ("ddp", "subgroup", "plugin"):
        DistTestCases.backend_feature[feature].add("ringzero")

# Tests that pass on gloo with CPU tensors and are skipped here, with the reason. Keep in step
# with docs/torch.md.
_ANY_SOURCE = "recv from any source (src=None): ringzero's messages name their sender"
_MONITORED = "monitored_barrier is gloo's own debugging aid (it names gloo in its messages)"
_CUSTOM = ("DDP's logging names an out-of-tree backend's process group 'custom' "
           "(ProcessGroup::getBackendName of BackendType::CUSTOM), the test expects the name "
           "dist.get_backend() gives")
SKIPPED: dict[str, str] = {
    "test_send_recv_any_source": _ANY_SOURCE,
    "test_send_recv_any_source_autograd_profiler": _ANY_SOURCE,
    "test_send_recv_any_source_torch_profiler": _ANY_SOURCE,
    "test_sparse_all_reduce_sum": "sparse all_reduce: ringzero reduces dense buffers",
    "test_ddp_logging_data_cpu": _CUSTOM,
    "test_monitored_barrier_allreduce_hang": _MONITORED,
    "test_monitored_barrier_allreduce_hang_wait_all_ranks": _MONITORED,
    "test_monitored_barrier_failure_order": _MONITORED,
    "test_monitored_barrier_gloo": _MONITORED,
    "test_monitored_barrier_gloo_rank_0_timeout": _MONITORED,
    "test_monitored_barrier_gloo_subgroup": _MONITORED,
    "test_monitored_barrier_wait_all_ranks": _MONITORED,
}

# The fixed subset of scripts/test.sh: collectives of every kind, DDP, subgroups, p2p.
SUBSET = [
    "test_all_reduce_sum",
    "test_all_reduce_coalesced_sum",
    "test_broadcast",
    "test_reduce_sum",
    "test_all_gather",
    "test_all_gather_coalesced_simple",
    "test_reduce_full_group_sum",
    "test_gather",
    "test_scatter",
    "test_barrier",
    "test_isend",
    "test_batch_isend_irecv_gloo",
    "test_all_reduce_full_group_sum",
    "test_all_gather_object_subgroup",
    "test_DistributedDataParallelCPU",
]


class TestDistBackendWithSpawn(distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        if _args.fork:
            # torch's own CI ran this suite forked (test_distributed_fork) until CUDA made it
            # spawn; on CPU, forking before any process group or thread exists is what gloo's
            # run did. The ranks then skip importing torch.
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()


def _skip(name: str, reason: str):
    fn = getattr(TestDistBackendWithSpawn, name, None)
    if fn is None:
        return
    setattr(TestDistBackendWithSpawn, name, unittest.skip(f"ringzero: {reason}")(fn))


if not _args.gloo:
    for _name, _reason in SKIPPED.items():
        _skip(_name, _reason)


def _all_tests() -> list[str]:
    names = sorted(n for n in dir(TestDistBackendWithSpawn) if n.startswith("test_"))
    if _args.cpu:
        names = [n for n in names if not any(g in n.lower() for g in ("cuda", "nccl", "gpu"))]
    return names


if __name__ == "__main__":
    if _args.list:
        print("\n".join(_all_tests()))
        sys.exit(0)
    argv = [sys.argv[0]] + _rest
    if _args.subset:
        missing = [t for t in SUBSET if not hasattr(TestDistBackendWithSpawn, t)]
        if missing:
            sys.exit(f"distributed_suite: the subset names tests this torch lacks: {missing}")
        argv += [f"TestDistBackendWithSpawn.{t}" for t in SUBSET]
    elif _args.cpu and not _rest:
        argv += [f"TestDistBackendWithSpawn.{t}" for t in _all_tests()]
    run_tests(argv)
