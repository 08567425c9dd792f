"""Writes a PEP 503 "simple" package index over the wheels in FOLDER/files: FOLDER/<project>/index.html.

    python3 scripts/images/simple_index.py FOLDER

CI only (scripts/images/build.sh): the CPU server image's torch step reads this instead of PyTorch's
index where the machine holds the same torch wheel on disk. Project names are normalized as PEP 503 says
(runs of -, _ and . become one -, lower case); a wheel's project is its file name up to the first -.
"""

from __future__ import annotations

import html
import re
import sys
from collections import defaultdict
from pathlib import Path


def main(folder: Path) -> int:
    projects: dict[str, list[str]] = defaultdict(list)
    for wheel in sorted((folder / "files").glob("*.whl")):
        projects[re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()].append(wheel.name)
    for project, files in projects.items():
        page = folder / project
        page.mkdir(parents=True, exist_ok=True)
        links = "".join(f'<a href="../files/{html.escape(f)}">{html.escape(f)}</a>\n' for f in files)
        (page / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    print(f"{sum(map(len, projects.values()))} wheels of {len(projects)} projects indexed in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
