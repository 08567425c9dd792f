"""The Triton package's import name is `kubeinfer_kernels`: a top-level `kernels` of ours (a package in the
repository root or a `benchmarks/kernels.py`) shadowed Hugging Face's `kernels` package, which
transformers imports, so scripts run from the repository or from benchmarks/ failed with a circular import."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_module_of_ours_is_named_kernels() -> None:
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert (ROOT / "kernels" / "kubeinfer_kernels" / "__init__.py").exists()
    for folder in ("benchmarks", "scripts", "server", "tests", "."):
        assert not (ROOT / folder / "kernels.py").exists(), folder


def test_kernels_resolves_to_no_code_of_ours_from_the_root_and_benchmarks() -> None:
    """From the repository root and with benchmarks/ first on sys.path (a script run from there), `kernels`
    is either another distribution's package or absent, never a file of this repository."""
    probe = (
        "import importlib.util, sys\n"
        f"sys.path[:0] = [{str(ROOT / 'benchmarks')!r}, {str(ROOT)!r}]\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "origin = None if spec is None else (spec.origin or '')\n"
        "locs = [] if spec is None else list(spec.submodule_search_locations or [])\n"
        "print(repr((origin, locs)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    origin, _locs = eval(out.stdout.strip())
    # A namespace portion (the bare kernels/ folder, no __init__.py) loses to any installed regular package
    # and holds no module; a regular module or package from this tree is the fault.
    if origin:
        assert not str(origin).startswith(str(ROOT)), origin
    import kubeinfer_kernels

    assert Path(kubeinfer_kernels.__file__).parent == ROOT / "kernels" / "kubeinfer_kernels"
