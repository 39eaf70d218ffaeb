"""Repository-wide pytest setup.

Each pytest-xdist worker compiles into an inductor cache of its own, removed when the
worker ends. Two workers sharing one raced once: in a fresh-clone CI run a CPU kernel of
the dispatch README's serving example failed to build (`at::vec` undeclared) while
another worker compiled, and the same test passed alone, with the shared cache and with
a fresh one.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

_worker = os.environ.get("PYTEST_XDIST_WORKER")
_own_cache = None
if _worker and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _own_cache = tempfile.mkdtemp(prefix=f"loka-inductor-{_worker}-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _own_cache


def pytest_sessionfinish(session, exitstatus):
    if _own_cache is not None:
        shutil.rmtree(_own_cache, ignore_errors=True)


@pytest.fixture
def two_gloo_ranks(tmp_path):
    """Runs a worker script as ranks 0 and 1 of a gloo group (``MASTER_ADDR``/``PORT`` set;
    the rank is ``sys.argv[1]``); each rank prints one JSON line last. Returns the two
    parsed lines, rank 0 first; a rank that fails fails the test with its stderr."""

    def run(source: str, timeout: float = 300.0) -> list[dict]:
        script = tmp_path / "gloo_worker.py"
        script.write_text(source)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), str(rank)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        outputs = [p.communicate(timeout=timeout) for p in procs]
        for rank, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
            assert p.returncode == 0, f"rank {rank}: {err[-3000:]}"
        return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]

    return run
