"""The README's `make test` runs what CI runs (issue 50 item 10): both install the Debian packages the
tests need through one script, and that script covers every external program a test skips without."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "scripts/install-test-deps.sh"


def _make_recipe(target: str) -> str:
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{target}:[^\n]*\n((?:\t[^\n]*\n)+)", text, re.M)
    assert m, target
    return m.group(1)


def test_make_test_and_ci_install_the_same_packages() -> None:
    assert SCRIPT in _make_recipe("test")
    assert f"bash {SCRIPT}" in (ROOT / ".ci" / "run").read_text()
    assert "apt-get" not in (ROOT / ".ci" / "run").read_text()  # one place installs them


def test_the_script_covers_every_program_tests_skip_without() -> None:
    script = (ROOT / SCRIPT).read_text()
    skipped_without = set()
    for path in (ROOT / "tests").rglob("*.py"):
        skipped_without |= set(re.findall(r'shutil\.which\("([a-z0-9_-]+)"\)', path.read_text()))
    # hadolint comes from PyPI (scripts/setup-helm.sh); chromium-browser is another distribution's name
    wanted = skipped_without - {"hadolint", "chromium-browser"}
    assert wanted >= {"prometheus", "promtool", "chromium"}
    for program in sorted(wanted | {"buildah", "debootstrap"}):
        assert f"[{program}]=" in script, program
