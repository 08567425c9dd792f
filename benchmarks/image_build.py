"""Build time and size of each image `make images` builds; prints JSON.

    python benchmarks/image_build.py [server-cpu|operator|router ...]   # builds them, one after another
    python benchmarks/image_build.py --sizes-only                       # sizes of the images already built

Each build runs scripts/images/build.sh for one image (buildah, vfs storage, chroot isolation; the
stand-in bases with KUBEINFER_STANDIN_BASES=1, made once beforehand and not timed). The size is the
uncompressed size buildah reports (the sum of the layers, as `docker image ls` shows it); a registry
stores the layers gzip-compressed, smaller.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGES = {
    "server-cpu": "ghcr.io/kubeinfer/server:0.1.0-cpu",
    "operator": "ghcr.io/kubeinfer/operator:0.1.0",
    "router": "ghcr.io/kubeinfer/router:0.1.17",
}


def size_bytes(ref: str) -> int | None:
    """The sum of the image's layers as stored here (uncompressed tar), or None if it is not built."""
    out = subprocess.run(
        ["buildah", "--storage-driver", "vfs", "inspect", "--type", "image", ref],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        return None
    manifest = json.loads(json.loads(out.stdout)["Manifest"])
    return sum(int(layer["size"]) for layer in manifest["layers"])


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("images", nargs="*", help=f"of {', '.join(IMAGES)} (default: all)")
    parser.add_argument("--sizes-only", action="store_true")
    args = parser.parse_args()
    targets = [] if args.sizes_only else (args.images or list(IMAGES))
    if unknown := set(targets) - set(IMAGES):
        parser.error(f"unknown images {sorted(unknown)}")
    result: dict[str, object] = {"cpu": cpu_model(), "cores": os.cpu_count(), "builds": {}, "sizes": {}}
    if targets and os.environ.get("KUBEINFER_STANDIN_BASES") == "1":
        subprocess.run(["bash", "scripts/images/standin-bases.sh"], cwd=REPO, check=True)  # not timed
    for name in targets:
        start = time.monotonic()
        subprocess.run(["bash", "scripts/images/build.sh", name], cwd=REPO, check=True)
        result["builds"][name] = {"seconds": round(time.monotonic() - start, 1)}  # type: ignore[index]
    for name, ref in IMAGES.items():
        result["sizes"][name] = {"image": ref, "bytes": size_bytes(ref)}  # type: ignore[index]
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
