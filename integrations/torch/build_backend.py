"""The build backend of ringzero-torch: setuptools', run where torch can be imported.

The extension is compiled against the torch of the environment it is installed into (torch's
headers, libraries and C++ ABI are that build's), so that torch must be importable while
building. pip builds in an isolated environment that hides the target's site-packages; this
backend adds them back after the isolated ones, so setuptools comes from the build environment
and torch from the target. With --no-build-isolation nothing changes.
"""

import site
import sys

for _path in site.getsitepackages():
    if _path not in sys.path:
        sys.path.append(_path)

try:
    import torch  # noqa: F401
except ImportError as _err:  # pragma: no cover - the message is the point
    raise RuntimeError(
        "ringzero-torch is built against the torch installed in the environment it goes into, "
        f"and none is importable from {sys.executable}: install torch first (pip install torch)"
    ) from _err

from setuptools.build_meta import *  # noqa: E402,F401,F403
