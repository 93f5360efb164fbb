"""Builds ringzero_torch._C against the torch of this environment (torch.utils.cpp_extension).

ringzero is header-only: its headers come from this checkout (../../include) or from
RINGZERO_INCLUDE_DIR. RINGZERO_TORCH_CXXFLAGS adds compiler flags (the default optimizes at
-O2); MAX_JOBS bounds the parallel compiles, as for any torch extension.
"""

import os
import pathlib
import shlex

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = pathlib.Path(__file__).resolve().parent
include = pathlib.Path(os.environ.get("RINGZERO_INCLUDE_DIR", here.parent.parent / "include"))
if not (include / "ringzero" / "collectives.hpp").is_file():
    raise RuntimeError(
        f"ringzero's headers are not at {include}: build from a ringzero checkout "
        "(pip install ./integrations/torch) or set RINGZERO_INCLUDE_DIR"
    )

csrc = "ringzero_torch/csrc"
flags = [
    "-std=c++20",
    "-O2",
    # torch ships {fmt}'s headers and puts them first on the include path; header-only mode
    # uses them without linking a library.
    "-DFMT_HEADER_ONLY",
    "-Wall",
] + shlex.split(os.environ.get("RINGZERO_TORCH_CXXFLAGS", ""))

setup(
    ext_modules=[
        CppExtension(
            "ringzero_torch._C",
            # The typed collectives (comm_shm, comm_socket) are the slow part: one file each,
            # so that they compile in parallel.
            sources=[
                f"{csrc}/comm_shm.cpp",
                f"{csrc}/comm_socket.cpp",
                f"{csrc}/comm_make.cpp",
                f"{csrc}/backend.cpp",
                f"{csrc}/module.cpp",
            ],
            include_dirs=[str(include), str(here / csrc)],
            extra_compile_args=flags,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
