#!/usr/bin/env bash
# `make images`: builds the images from their Dockerfiles, unchanged, with buildah (vfs storage, chroot
# isolation: no daemon, works as root in a container) or, where buildah is absent, docker.
#   scripts/images/build.sh [server-cpu|operator|router]...   (default: all three)
# The CUDA server image (Dockerfile.server's defaults) is built by `docker build -f Dockerfile.server .`;
# it is linted in CI but never built there (no CUDA base image can be pulled on CI's machine).
#
# On a machine that cannot pull from a container registry (CI's), KUBEINFER_STANDIN_BASES=1 first makes
# stand-in base images from Debian's packages (scripts/images/standin-bases.sh) and builds with
# --pull=never. Where a local copy of the exact torch wheel exists ($TORCH_WHEEL_DIR, default
# /opt/wheels), the torch step reads it through a local package index instead of PyPI's torch index.
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
SERVER_CPU_IMAGE=${SERVER_CPU_IMAGE:-ghcr.io/kubeinfer/server:$VERSION-cpu}
OPERATOR_IMAGE=${OPERATOR_IMAGE:-ghcr.io/kubeinfer/operator:$VERSION}
ROUTER_IMAGE=${ROUTER_IMAGE:-ghcr.io/kubeinfer/router:0.1.17}
CACHE=${KUBEINFER_IMAGE_CACHE:-$PWD/.cache/images}
TORCH_WHEEL_DIR=${TORCH_WHEEL_DIR:-/opt/wheels}
# The CPU build of Dockerfile.server (its header shows the same arguments for docker).
CPU_BUILD_ARGS=(
  --build-arg BASE_IMAGE=debian:12.12-slim
  --build-arg PYTHON=python3.11
  --build-arg TORCH_CUDA=cpu
  --build-arg EXTRAS=s3
  --build-arg RUNTIME_PACKAGES=libgomp1
  --build-arg PRUNE_PACKAGES=triton
)
mkdir -p "$CACHE"

if command -v buildah >/dev/null 2>&1; then
  BUILD=(buildah build --storage-driver vfs --isolation chroot --layers=false --format docker)
  STORAGE="--storage-driver vfs"
elif command -v docker >/dev/null 2>&1; then
  BUILD=(docker build)
  STORAGE=""
else
  echo "error: neither buildah nor docker is installed" >&2
  exit 1
fi
EXTRA=()
if [ "${KUBEINFER_STANDIN_BASES:-0}" = 1 ]; then
  [ "${BUILD[0]}" = buildah ] || { echo "error: stand-in bases need buildah" >&2; exit 1; }
  BUILDAH="buildah $STORAGE" KUBEINFER_IMAGE_CACHE="$CACHE" bash scripts/images/standin-bases.sh
  EXTRA+=(--pull=never)
fi

torch_index_args() {  # a local index for the CPU torch wheel and its dependencies, when the machine has the file
  local wheel index=$CACHE/torch-index
  wheel=$(ls "$TORCH_WHEEL_DIR"/torch-2.13.0+cpu-cp311-cp311-manylinux*_x86_64.whl 2>/dev/null | head -1) || true
  [ -n "$wheel" ] && [ "${BUILD[0]}" = buildah ] || return 0
  if [ ! -f "$index/.complete" ]; then
    # torch's own dependencies come from PyPI through this machine's pip (its proxy and certificates),
    # as wheels for the image's Python (3.11, manylinux x86-64); the torch wheel from the local file.
    python3 -m pip download -q --disable-pip-version-check --dest "$index/files" --find-links "$TORCH_WHEEL_DIR" \
      --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 \
      --platform manylinux_2_28_x86_64 "torch==2.13.0+cpu" >&2
    python3 scripts/images/simple_index.py "$index" >&2
    touch "$index/.complete"
  fi
  echo "-v $index:/torch-index:ro --build-arg TORCH_INDEX_URL=file:///torch-index"
}

image_id() {  # $1: a tag; its image's ID, or nothing
  if [ "${BUILD[0]}" = buildah ]; then
    buildah $STORAGE images --quiet --no-trunc "$1" 2>/dev/null | head -1 || true
  else
    docker image inspect --format '{{.Id}}' "$1" 2>/dev/null || true
  fi
}

build() {  # $1: name, $2: the tag, then arguments for the build
  local name=$1 tag=$2 start old new
  shift 2
  start=$(date +%s)
  echo "building $name" >&2
  old=$(image_id "$tag")
  "${BUILD[@]}" "${EXTRA[@]}" -t "$tag" "$@" .
  # The tag moved to the new image: the old one is left nameless, and with vfs storage (a full copy of
  # the filesystem per layer) every rebuild would keep another 2 GB on disk. A container still using it
  # keeps it (rmi refuses).
  new=$(image_id "$tag")
  if [ -n "$old" ] && [ "$old" != "$new" ]; then
    if [ "${BUILD[0]}" = buildah ]; then
      buildah $STORAGE rmi "$old" >/dev/null 2>&1 || echo "kept the superseded image $old (in use)" >&2
    else
      docker rmi "$old" >/dev/null 2>&1 || echo "kept the superseded image $old (in use)" >&2
    fi
  fi
  echo "built $name in $(($(date +%s) - start)) s" >&2
}

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(server-cpu operator router)
for target in "${targets[@]}"; do
  case $target in
    server-cpu)
      # shellcheck disable=SC2046
      build "$target" "$SERVER_CPU_IMAGE" -f Dockerfile.server "${CPU_BUILD_ARGS[@]}" $(torch_index_args) ;;
    operator) build "$target" "$OPERATOR_IMAGE" -f Dockerfile.operator ;;
    router) build "$target" "$ROUTER_IMAGE" -f Dockerfile.router ;;
    *) echo "error: unknown image $target (server-cpu, operator, router)" >&2; exit 2 ;;
  esac
done
