"""docs/models.md is generated from the registry: it cannot drift from the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from server.models.registry import ARCHITECTURES, markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_models_doc_is_the_registry_s() -> None:
    assert DOC.read_text() == markdown(), (
        "docs/models.md differs from the registry: regenerate it with "
        "`python -m server.models.registry --markdown > docs/models.md`"
    )
    for name in ARCHITECTURES:
        assert f"`{name}`" in DOC.read_text()


def test_markdown_command_prints_the_doc() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "server.models.registry", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
        cwd=DOC.parents[1],
    )
    assert out.stdout == markdown()
