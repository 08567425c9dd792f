"""benchmarks/embeddings.py counts a server's CPU with its child processes (vLLM's engine core is a child
of its API server): a child's CPU is in `tree_cpu_s` of its parent while the child lives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from embeddings import process_cpu_s, tree_cpu_s  # benchmarks/ on sys.path

# burns 0.3 s of its own CPU, says so, then waits for stdin to close
_CHILD = (
    "import sys, time\n"
    "while time.process_time() < 0.3:\n"
    "    pass\n"
    "print('done', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_child_process_cpu_is_counted() -> None:
    me = os.getpid()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "done"
        own = process_cpu_s(me)
        whole = tree_cpu_s(me)
        assert whole - own >= 0.25, (whole, own)  # the child's 0.3 s, at the clock tick's resolution
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)
