# Source this on the GPU host (no network, torch/triton preinstalled): installs the wheels
# carried in .whl/ or .device-carry/ (loka-stats, polars, torchao; a wheel too large for the
# carry limit may come unpacked as a .tar.xz of its contents) into /tmp/site and puts every
# LoKA package's source on PYTHONPATH (LOKA_SKIP_WHEELS=1: only the path).
# Usage: `source bench/gpu_env.sh && python3 bench/kernels.py`.
LOKA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
for carried in "$LOKA_ROOT/.whl" "$LOKA_ROOT/.device-carry"; do
    if [ -z "${LOKA_SKIP_WHEELS:-}" ] && compgen -G "$carried/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$carried"/*.whl || return 1
    fi
    if [ -z "${LOKA_SKIP_WHEELS:-}" ] && compgen -G "$carried/*.tar.xz" >/dev/null; then
        for archive in "$carried"/*.tar.xz; do tar -xJf "$archive" -C /tmp/site || return 1; done
    fi
done
LOKA_SRC=""
for pkg in packages/schema packages/zoo kernels packages/probe packages/mods packages/dispatch \
    packages/lordba packages/plora packages/reprec; do
    LOKA_SRC="$LOKA_SRC:$LOKA_ROOT/$pkg/src"
done
export PYTHONPATH="/tmp/site${LOKA_SRC}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
