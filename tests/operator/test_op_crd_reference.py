"""docs/operator.md's spec reference is the CRD's own descriptions (scripts/crd_reference.py), so what
`kubectl explain` says and what the docs say cannot drift apart (found on kube-apiserver 1.36: explain
still said "(0 needs KEDA)" for spec.scaling.minReplicas after scale to zero had stopped needing it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("crd_reference", ROOT / "scripts" / "crd_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("crd_reference", module)
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_is_generated_from_the_crd() -> None:
    gen = _generator()
    doc = (ROOT / "docs" / "operator.md").read_text()
    want = gen.render_doc(doc, gen.table(gen.spec_schema()))
    assert doc == want, (
        "docs/operator.md's spec reference is stale: run python scripts/crd_reference.py --write"
    )


def test_every_spec_field_is_described() -> None:
    gen = _generator()
    missing = [
        path for path, sub in gen.fields(gen.spec_schema()) if not (sub.get("description") or "").strip()
    ]
    assert missing == []


def test_no_description_says_scale_to_zero_needs_keda() -> None:
    gen = _generator()
    texts = {path: str(sub.get("description") or "") for path, sub in gen.fields(gen.spec_schema())}
    assert "needs KEDA" not in texts["scaling.minReplicas"]
    assert "activator" in texts["scaling.minReplicas"]
