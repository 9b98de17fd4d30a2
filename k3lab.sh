#!/usr/bin/env bash
# k3lab set-up and entry point for a fresh machine. Installs only what is missing, then:
#   ./k3lab.sh app    open the app on the shipped sample checkpoints
#   ./k3lab.sh test   run the test suite
#   ./k3lab.sh ARGS   anything else is passed to the `k3lab` command (train, report, inspect, ...)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=${K3LAB_TORCH:-2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "k3lab: creating $VENV"
  "$PY" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }

# torch first and pinned: an unpinned torch can pull a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "k3lab: installing torch==$TORCH_VERSION"
  pip_install "torch==$TORCH_VERSION"
fi
# The project and its test tools; re-run only when pyproject.toml changed.
stamp="$VENV/.k3lab-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "k3lab: installing k3lab and its dependencies"
  pip_install -e ".[test]"
  touch "$stamp"
fi

need_chromium() {
  # Static plot export (kaleido) and the browser tests use the system Chromium.
  if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "k3lab: installing chromium (static export, browser tests)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "k3lab: could not install chromium; PNG/SVG export and browser tests will be skipped"
  fi
}

case "${1:-app}" in
  app)
    shift || true
    need_chromium
    # the shipped samples: every folder of sample_checkpoints/ that is a checkpoint (not campaign/, the runs
    # being trained to replace them)
    if [ "$#" -eq 0 ]; then for c in sample_checkpoints/*/config.json; do set -- "$@" "${c%config.json}"; done; fi
    exec "$VENV/bin/k3lab" app "$@"
    ;;
  test)
    shift || true
    need_chromium
    # flash-linear-attention's pure-torch KDA reference, for the cross-check in tests/k3core/ops/test_ops_kda.py
    # (--no-deps: its package needs triton and a GPU; the test loads naive.py by file path).
    if ! "$VENV/bin/python" -m pip show -q fla-core >/dev/null 2>&1; then
      pip_install --no-deps fla-core || echo "k3lab: fla-core not installed; the fla cross-check will skip"
    fi
    # Two pytest-xdist workers (the machine's 2 cores; K3LAB_TEST_WORKERS changes it), each test module on one of them
    # as a whole (tests/conftest.py: module fixtures built once, shared replicas kept together, long modules first).
    # `./k3lab.sh test -n0 ...` runs plain pytest.
    exec "$VENV/bin/python" -m pytest -q -n "${K3LAB_TEST_WORKERS:-2}" --dist loadfile "$@"
    ;;
  *)
    exec "$VENV/bin/k3lab" "$@"
    ;;
esac
