#!/usr/bin/env bash
# Debian packages some tests need: Prometheus and promtool (the scrape and rule tests), Chromium (the
# playground's browser tests), buildah and debootstrap (the image builds). `make test` and .ci/run both
# call this, so the README's test command runs what CI runs. Installs only what is missing, only as root
# with apt-get; otherwise it says which tests will skip and why. Never fails the caller.
set -uo pipefail
declare -A NEED=([prometheus]=prometheus [promtool]=prometheus [chromium]=chromium [buildah]=buildah [debootstrap]=debootstrap)
declare -A WHY=([prometheus]="the Prometheus scrape and rule tests" [chromium]="the playground browser tests" [buildah]="the image build tests" [debootstrap]="the image build tests")
missing=()
for cmd in "${!NEED[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${NEED[$cmd]}")
done
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u | sed '/^$/d')
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian packages the tests need: ${missing[*]}"
  APT=(-o Acquire::Retries=5)
  if apt-get "${APT[@]}" update -qq && DEBIAN_FRONTEND=noninteractive apt-get "${APT[@]}" install -y -qq "${missing[@]}" >/dev/null; then
    exit 0
  fi
  echo "warning: could not install ${missing[*]} with apt-get"
fi
for pkg in "${missing[@]}"; do
  echo "note: Debian's $pkg is not installed (needs root and apt-get): ${WHY[$pkg]} will skip"
done
exit 0
