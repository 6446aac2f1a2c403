#!/usr/bin/env bash
# Build (or reuse) the integration-test environment: kvstore (with the cluster extra,
# Mooncake Store's client) + vLLM + LMCache + SGLang + transformers, CPU only, kept
# apart from the core .venv. `make test` calls this
# and then runs `$VENV_INTEG/bin/pytest tests/integrations`.
#
#   tools/setup_integ_env.sh            # builds .venv-integ once; a no-op when up to date
#   VENV_INTEG=/tmp/v tools/setup_integ_env.sh
#
# Environment: PYTHON (python3.11), VENV_INTEG (.venv-integ), TORCH (torch==2.13.0,
# the CPU build these machines carry in /opt/wheels; elsewhere pass e.g.
# TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu").
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VENV=${VENV_INTEG:-.venv-integ}
TORCH=${TORCH:-torch==2.13.0}
STAMP="$VENV/.integ-installed"

up_to_date() {
    [ -f "$STAMP" ] || return 1
    local input
    for input in pyproject.toml requirements-integ.txt requirements-integ-nodeps.txt \
        tools/setup_integ_env.sh; do
        [ "$STAMP" -nt "$input" ] || return 1
    done
}

if up_to_date; then
    exit 0
fi

started=$(date +%s)
rm -f "$STAMP"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check --no-compile)
"${PIP[@]}" --upgrade pip
# shellcheck disable=SC2086  # TORCH may carry pip options (an index URL)
"${PIP[@]}" $TORCH
"${PIP[@]}" -e '.[dev,cluster]'  # cluster: Mooncake's client, for the adapters' real-master tests
"${PIP[@]}" -r requirements-integ.txt
"${PIP[@]}" --no-deps -r requirements-integ-nodeps.txt
# Fail here, with the import that is missing, rather than as skipped tests.
"$VENV/bin/python" - <<'PY'
import torch
import transformers
import vllm.v1.kv_offload.tiering.spec
import lmcache.v1.storage_backend
import kvstore.integrations.vllm
import kvstore.integrations.lmcache
import kvstore.integrations.lmcache_mp
import kvstore.integrations.sglang
import sglang.srt.mem_cache.storage.backend_factory
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.version.cuda, "a CUDA torch was installed; install the CPU build first"
PY
# Two imports in a row leave liburing's own import cache valid (Makefile, WARM_LIBURING).
"$VENV/bin/python" -c "import liburing" >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import liburing" >/dev/null 2>&1 || true
touch "$STAMP"
echo "integration environment ready in $VENV ($(( $(date +%s) - started )) s)"
