# Sourced by scripts/demo and scripts/test: makes sure uv exists and the workspace is installed.
# Works on a fresh machine with only Python 3.11+, pip, a Rust toolchain and access to PyPI/crates.io.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export UV_PYTHON_DOWNLOADS=never   # no network beyond the package registries: use the system Python
export UV_LINK_MODE="${UV_LINK_MODE:-copy}"
if command -v uv >/dev/null 2>&1; then
    UV=(uv)
else
    if ! python3 -m uv --version >/dev/null 2>&1; then
        echo "[loka] installing uv from PyPI" >&2
        python3 -m pip install --quiet --user uv
    fi
    # Put the binary pip installed on PATH too: once the workspace's venv comes first on PATH,
    # `python3 -m uv` would name the venv's Python, which has no uv (scripts and tests call it).
    UV_DIR="$(dirname "$(python3 -c 'import uv; print(uv.find_uv_bin())')")"
    export PATH="$PATH:$UV_DIR"
    UV=(uv)
fi
echo "[loka] syncing the workspace (first run downloads torch and builds the Rust crate)" >&2
"${UV[@]}" sync --all-packages --all-extras --locked --quiet
export PATH="$ROOT/.venv/bin:$PATH"
