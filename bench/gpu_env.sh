# Source this on the GPU host (no network, torch/triton preinstalled): installs the wheels
# carried in .whl/ (loka-stats, polars, torchao) into /tmp/site and puts every LoKA
# package's source on PYTHONPATH (LOKA_SKIP_WHEELS=1: only the path). Usage: `source bench/gpu_env.sh && python3 bench/kernels.py`.
LOKA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${LOKA_SKIP_WHEELS:-}" ] && compgen -G "$LOKA_ROOT/.whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$LOKA_ROOT"/.whl/*.whl || return 1
fi
LOKA_SRC=""
for pkg in packages/schema packages/zoo kernels packages/probe packages/mods packages/dispatch; do
    LOKA_SRC="$LOKA_SRC:$LOKA_ROOT/$pkg/src"
done
export PYTHONPATH="/tmp/site${LOKA_SRC}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
