#!/usr/bin/env bash
# Copies the files the chart ships from their sources: crds/ (the operator's CRDs) into the chart, and
# the chart's dashboards (their source) to the top-level dashboards/ that users import by hand.
# tests/deploy/test_deploy_chart_files.py and test_deploy_monitoring.py fail when these drift apart.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f charts/kubeinfer/crds/*.yaml
cp crds/*.yaml charts/kubeinfer/crds/
rm -f dashboards/*.json
cp charts/kubeinfer/dashboards/*.json dashboards/
