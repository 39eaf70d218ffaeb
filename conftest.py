"""Repository-wide pytest setup.

Each pytest-xdist worker compiles into an inductor cache of its own, removed when the
worker ends. Two workers sharing one raced once: in a fresh-clone CI run a CPU kernel of
the dispatch README's serving example failed to build (`at::vec` undeclared) while
another worker compiled, and the same test passed alone, with the shared cache and with
a fresh one.
"""

import os
import shutil
import tempfile

_worker = os.environ.get("PYTEST_XDIST_WORKER")
_own_cache = None
if _worker and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _own_cache = tempfile.mkdtemp(prefix=f"loka-inductor-{_worker}-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _own_cache


def pytest_sessionfinish(session, exitstatus):
    if _own_cache is not None:
        shutil.rmtree(_own_cache, ignore_errors=True)
