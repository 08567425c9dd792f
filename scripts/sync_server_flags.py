"""Regenerates the operator's copy of the server's flags from server/cli.py's own parser: the table in
operator/kubeinfer_operator/server_args.py (arity, value kind, choices of every flag the operator lets
through) and the CRD's CEL list of those flags (crds/ and the chart's copy); and the variables the
parser reads (admission.SERVER_ENV, refused in pod.env, and the CRD's pod.env rule). The operator image carries
no server package, hence the copy; tests/operator/test_op_server_flags.py and test_op_server_args.py
fail when it drifts.

    python scripts/sync_server_flags.py           # rewrite both
    python scripts/sync_server_flags.py --check   # exit 1 if either would change
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "operator")]

TABLE_FILE = ROOT / "operator" / "kubeinfer_operator" / "server_args.py"
ADMISSION_FILE = ROOT / "operator" / "kubeinfer_operator" / "admission.py"
ENV_BEGIN = "SERVER_ENV: tuple[str, ...] = (\n"
CRDS = [
    ROOT / "crds" / "kubeinfer.dev_inferencemodels.yaml",
    ROOT / "charts" / "kubeinfer" / "crds" / "kubeinfer.dev_inferencemodels.yaml",
]
BEGIN = "SERVER_FLAG_TABLE: dict[str, ServerFlag] = {\n"
END = "\n}\n"
# Value kinds that hold their choices inside the type function (server/cli.py): the choices they take.
CHOICE_TYPES = {"_kv_cache_dtype": "KV_CACHE_DTYPE_CHOICES"}


def table_source() -> str:
    from kubeinfer_operator.spec import MANAGED_FLAGS

    import server.config as server_config
    from server.cli import build_parser

    lines = []
    actions = {o: a for a in build_parser({})._actions for o in a.option_strings if o.startswith("--")}
    for flag in sorted(set(actions) - MANAGED_FLAGS - {"--help"}):
        action = actions[flag]
        if action.nargs == 0:
            lines.append(f'    "{flag}": _SWITCH,')
            continue
        kind = getattr(action.type, "__name__", "str") if action.type is not None else "str"
        choices = tuple(str(c) for c in (action.choices or ()))
        if kind in CHOICE_TYPES:
            kind, choices = "str", tuple(getattr(server_config, CHOICE_TYPES[kind]))
        args = f'"{kind}"' + (f", {choices!r}" if choices else "")
        lines.append(f'    "{flag}": ServerFlag({args}),')
    return "\n".join(lines)


def server_env() -> list[str]:
    from server.cli import build_parser

    parser = build_parser({})
    return sorted({m for a in parser._actions for m in re.findall(r"\[env: ([A-Z0-9_]+)\]", a.help or "")})


def rewrite_env(text: str, names: list[str]) -> str:
    start = text.index(ENV_BEGIN) + len(ENV_BEGIN)
    end = text.index("\n)\n", start)
    return text[:start] + "\n".join(f'    "{n}",' for n in names) + text[end:]


def rewrite_crd_env(text: str, names: list[str]) -> str:
    from kubeinfer_operator.admission import REFUSED_ENV_NAMES

    listed = ", ".join(f"'{n}'" for n in [*REFUSED_ENV_NAMES, *names])
    pattern = re.compile(r"(self\.env\.all\(e, .*?!\(e\.name in \[)('GCONV_PATH'[^\]]*)(\]\))")
    new, count = pattern.subn(lambda m: m.group(1) + listed + m.group(3), text)
    if count != 1:
        raise SystemExit(f"expected one pod.env rule in the CRD, found {count}")
    return new


def rewrite_table(text: str, body: str) -> str:
    """The module with the new table, formatted as `make lint` wants it (ruff format, the dev tools)."""
    start = text.index(BEGIN) + len(BEGIN)
    end = text.index(END, start)
    new = text[:start] + body + text[end:]
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(TABLE_FILE), "-"],
        input=new,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return out.stdout


def rewrite_crd(text: str, flags: list[str]) -> str:
    listed = ", ".join(f"'{f}'" for f in flags)
    pattern = re.compile(r"(self\.extraArgs\.all\(a, !a\.startsWith\('--'\) \|\| \[)([^\]]*)(\])")
    new, count = pattern.subn(lambda m: m.group(1) + listed + m.group(3), text)
    if count != 1:
        raise SystemExit(f"expected one extraArgs allow-list rule in the CRD, found {count}")
    return new


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    body = table_source()
    flags = [line.split('"')[1] for line in body.splitlines()]
    env = server_env()
    changed = []
    for path, new in [
        (TABLE_FILE, rewrite_table(TABLE_FILE.read_text(), body)),
        (ADMISSION_FILE, rewrite_env(ADMISSION_FILE.read_text(), env)),
    ] + [(crd, rewrite_crd_env(rewrite_crd(crd.read_text(), flags), env)) for crd in CRDS]:
        if path.read_text() != new:
            changed.append(path)
            if not args.check:
                path.write_text(new)
    for path in changed:
        print(f"{'stale' if args.check else 'rewrote'}: {path.relative_to(ROOT)}")
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
