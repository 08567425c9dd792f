#!/usr/bin/env bash
# CI only: stand-in base images for a machine that cannot pull from a container registry.
#
# Dockerfile.operator and Dockerfile.router start FROM python:3.11.14-slim-bookworm and the CPU build of
# Dockerfile.server FROM debian:12.12-slim. Where no registry is reachable, this script makes both
# from Debian's own packages with debootstrap and commits them into buildah's local storage under the
# names the Dockerfiles' FROM lines resolve to (docker.io/library/...), so `buildah build --pull=never`
# uses them. The Dockerfiles stay exactly what a user builds; only the bases differ:
#   debian:12.12-slim             <- debootstrap --variant=minbase bookworm (what the real one is made
#                                    from; today's bookworm point release, not necessarily 12.12)
#   python:3.11.14-slim-bookworm  <- the same plus Debian's python3.11 (3.11.2, not 3.11.14) with venv,
#                                    linked as /usr/local/bin/python{,3} like the real image's python.
# Both carry this machine's CA bundle ($HOST_CA_BUNDLE, as /usr/local/share/kubeinfer-ci/ca-bundle.crt)
# with PIP_CERT and SSL_CERT_FILE pointing at it, so
# that pip in a build trusts what the machine trusts (CI's egress is a TLS-intercepting proxy).
# The debootstrap root is kept in $KUBEINFER_IMAGE_CACHE (default .cache/images) and a base that is
# already in storage is not made again, so one CI run makes each base once.
set -euo pipefail
BUILDAH=${BUILDAH:-buildah --storage-driver vfs}
CACHE=${KUBEINFER_IMAGE_CACHE:-.cache/images}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
HOST_CA_BUNDLE=${HOST_CA_BUNDLE:-${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}
DEBIAN_IMAGE=docker.io/library/debian:12.12-slim
PYTHON_IMAGE=docker.io/library/python:3.11.14-slim-bookworm
mkdir -p "$CACHE"

have() { $BUILDAH inspect --type image "$1" >/dev/null 2>&1; }

debian_rootfs() {
  local dir="$CACHE/debian.rootfs"
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    debootstrap --variant=minbase "$SUITE" "$dir" "$MIRROR" >&2
    clean "$dir"
    touch "$dir/.complete"
  fi
  echo "$dir"
}

python_rootfs() {  # Debian's root plus its python3.11, installed with the root's own apt
  local dir="$CACHE/python.rootfs"
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    cp -a "$(debian_rootfs)" "$dir"
    rm -f "$dir/.complete"
    cp /etc/resolv.conf "$dir/etc/resolv.conf"
    chroot "$dir" sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends python3.11 python3.11-venv ca-certificates >/dev/null' >&2
    : > "$dir/etc/resolv.conf"
    ln -sf /usr/bin/python3.11 "$dir/usr/local/bin/python3"
    ln -sf /usr/bin/python3.11 "$dir/usr/local/bin/python"
    clean "$dir"
    touch "$dir/.complete"
  fi
  echo "$dir"
}

clean() {  # as the official slim images: no apt lists or package caches in the base
  rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/cache/apt/archives/*.deb
}

commit() {  # $1: rootfs, $2: image name, then `buildah config` arguments
  local dir=$1 name=$2 ctr mnt
  shift 2
  ctr=$($BUILDAH from scratch)
  mnt=$($BUILDAH mount "$ctr")
  tar -C "$dir" --exclude=./.complete -cf - . | tar -C "$mnt" -xf -
  # This machine's trust store: its egress to PyPI goes through a TLS proxy whose CA only the
  # machine's bundle holds, and pip in a build trusts only certifi's unless PIP_CERT says otherwise.
  # Kept outside /etc/ssl, which Debian's ca-certificates rewrites when a build installs it.
  if [ -f "$HOST_CA_BUNDLE" ]; then
    mkdir -p "$mnt/usr/local/share/kubeinfer-ci"
    cp "$HOST_CA_BUNDLE" "$mnt/usr/local/share/kubeinfer-ci/ca-bundle.crt"
    set -- --env PIP_CERT=/usr/local/share/kubeinfer-ci/ca-bundle.crt \
      --env SSL_CERT_FILE=/usr/local/share/kubeinfer-ci/ca-bundle.crt "$@"
  fi
  $BUILDAH umount "$ctr" >/dev/null
  $BUILDAH config --os linux --arch amd64 \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@" "$ctr"
  $BUILDAH commit --quiet --rm "$ctr" "$name" >/dev/null
  echo "stand-in base $name committed" >&2
}

if ! have "$DEBIAN_IMAGE"; then
  commit "$(debian_rootfs)" "$DEBIAN_IMAGE"
fi
if ! have "$PYTHON_IMAGE"; then
  commit "$(python_rootfs)" "$PYTHON_IMAGE" --env LANG=C.UTF-8 --env PYTHON_VERSION=3.11.2
fi
