"""``flexdispatch doctor``'s DeepEP 2.5 preflight: which generations import, and each run-time
need (nvcc >= 13.1, a C++20 compiler, NCCL >= 2.32.3 with headers and the same library loaded,
ibstat / nvidia-smi) passing and failing with its fix, on stand-ins for the machine.

Shape letters: R ranks · L ranks per node.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from flexdispatch.cli import main
from flexdispatch.doctor import deepep_api_choice, format_report, run_doctor
from flexdispatch.doctor.v25 import probe_generations, probe_v25_runtime


class _Run:
    """``subprocess.run`` stand-in: nvcc prints ``release``, the compiler returns ``cxx_rc``."""

    def __init__(self, nvcc: str | None = "13.1", cxx_rc: int = 0) -> None:
        self.nvcc, self.cxx_rc = nvcc, cxx_rc
        self.calls: list[list[str]] = []

    def __call__(self, cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
        self.calls.append(cmd)
        if cmd[-1] == "--version":
            if self.nvcc is None:
                raise FileNotFoundError(cmd[0])
            out = f"Cuda compilation tools, release {self.nvcc}, V{self.nvcc}.0"
            return subprocess.CompletedProcess(cmd, 0, out, "")
        assert "-std=c++20" in cmd and "concepts" in kw["input"]
        return subprocess.CompletedProcess(cmd, self.cxx_rc, "", "error: c++20")


def _nccl(root: Path, version: tuple[int, int, int], lib: bytes = b"nccl") -> Path:
    (root / "include").mkdir(parents=True)
    (root / "lib").mkdir()
    major, minor, patch = version
    (root / "include" / "nccl.h").write_text(
        f"#define NCCL_MAJOR {major}\n#define NCCL_MINOR {minor}\n#define NCCL_PATCH {patch}\n"
    )
    (root / "lib" / "libnccl.so.2").write_bytes(lib)
    return root


def _probe(tmp_path: Path, **kw: Any) -> dict[str, dict[str, Any]]:
    env = kw.pop("env", {})
    tools = kw.pop("tools", {"nvcc", "g++", "ibstat", "nvidia-smi"})
    maps = tmp_path / "maps"
    maps.write_text(kw.pop("maps", ""))
    checks = probe_v25_runtime(
        env=env,
        which=lambda name: f"/usr/bin/{name}" if name in tools else None,
        run=kw.pop("run", _Run()),
        maps=str(maps),
        torch_cuda=kw.pop("torch_cuda", "13.0"),
        nccl_loaded=kw.pop("nccl_loaded", None),
        links=lambda: kw.pop("links", (478.0, 50.0, False)),
    )
    return {c["name"]: c for c in checks}


def test_a_machine_that_has_everything_passes(tmp_path: Path) -> None:
    root = _nccl(tmp_path / "nccl", (2, 32, 3))
    lib = root / "lib" / "libnccl.so.2"
    maps = f"7f00-7f01 r-xp 0 00:00 1 {lib}\n"
    got = _probe(tmp_path, env={"EP_NCCL_ROOT_DIR": str(root)}, maps=maps, nccl_loaded=(2, 32, 3))
    assert set(got) == {
        "wheel",
        "torch_cuda",
        "nvcc",
        "cxx20",
        "nccl",
        "nccl_loaded",
        "ibstat",
        "nvidia-smi",
        "links",
        "gin",
    }
    failing = {k: c for k, c in got.items() if not c["ok"] and k != "wheel"}
    assert not failing, failing
    assert got["nvcc"]["detail"] == "/usr/bin/nvcc: CUDA 13.1" and got["nccl"]["fix"] == ""
    assert "2.32.3" in got["nccl_loaded"]["detail"]


@pytest.mark.parametrize(
    ("kw", "name", "fix"),
    [
        ({"torch_cuda": "12.8"}, "torch_cuda", "cu130"),
        ({"run": _Run(nvcc="13.0")}, "nvcc", "CUDA 13.1+ toolkit"),
        ({"run": _Run(nvcc="12.9")}, "nvcc", "EP_JIT_NVCC_COMPILER"),
        ({"run": _Run(nvcc=None)}, "nvcc", "put its nvcc on PATH"),
        ({"run": _Run(cxx_rc=1)}, "cxx20", "GCC >= 10"),
        ({"tools": {"nvcc"}}, "cxx20", "apt-get install g++"),
        ({"tools": {"nvcc", "g++"}}, "ibstat", "infiniband-diags"),
        ({"tools": {"nvcc", "g++"}}, "nvidia-smi", "NVIDIA driver utilities"),
    ],
)
def test_each_need_fails_with_its_fix(tmp_path: Path, kw: dict, name: str, fix: str) -> None:
    got = _probe(tmp_path, **kw)[name]
    assert not got["ok"] and fix in got["fix"], got
    assert got["level"] == ("warning" if name in ("ibstat", "nvidia-smi") else "error")


def test_nvcc_is_found_where_deepep_looks(tmp_path: Path) -> None:
    run = _Run()
    _probe(tmp_path, env={"CUDA_HOME": "/opt/cuda-13.2"}, run=run)
    assert run.calls[0] == ["/opt/cuda-13.2/bin/nvcc", "--version"]
    run = _Run()
    _probe(tmp_path, env={"EP_JIT_NVCC_COMPILER": "/x/nvcc", "CUDA_HOME": "/y"}, run=run)
    assert run.calls[0][0] == "/x/nvcc"


def test_nccl_too_old_missing_or_not_the_one_loaded(tmp_path: Path) -> None:
    old = _nccl(tmp_path / "old", (2, 27, 7))
    got = _probe(tmp_path, env={"EP_NCCL_ROOT_DIR": str(old)})["nccl"]
    assert not got["ok"] and "2.27.7" in got["detail"] and "nvidia-nccl-cu13>=2.32.3" in got["fix"]
    got = _probe(tmp_path, env={"NCCL_DIR": str(tmp_path / "nowhere")})["nccl"]
    assert not got["ok"] and "no nccl.h" in got["detail"]
    new = _nccl(tmp_path / "new", (2, 32, 6), lib=b"v2.32.6")
    other = tmp_path / "torch_libnccl.so.2"
    other.write_bytes(b"v2.27.7")
    got = _probe(tmp_path, env={"EP_NCCL_ROOT_DIR": str(new)}, maps=f"a-b r-xp 0 0 1 {other}\n")[
        "nccl_loaded"
    ]
    assert not got["ok"] and str(other) in got["detail"] and "EP_SUPPRESS_NCCL_CHECK" in got["fix"]
    got = _probe(tmp_path, env={"EP_NCCL_ROOT_DIR": str(new)}, nccl_loaded=(2, 27, 7))
    assert not got["nccl_loaded"]["ok"] and "(2.27.7)" in got["nccl_loaded"]["detail"]


def test_generations_report_each_api() -> None:
    gens = probe_generations({"usable": True, "elastic": True, "reason": "deep_ep imports"})
    assert gens["v1"]["ok"] and gens["v2"]["ok"] and gens["v2"]["api"] == "deep_ep.ElasticBuffer"
    gens = probe_generations({"usable": True, "elastic": False, "reason": "deep_ep imports"})
    assert gens["v1"]["ok"] and not gens["v2"]["ok"] and "no ElasticBuffer" in gens["v2"]["reason"]
    v25 = gens["v25"]
    assert v25["api"] == "deep_ep_v25.EPBuffer" and not v25["ok"]  # no CUDA torch here
    assert "deep_ep_v25 is installed but refused to import" in v25["reason"]  # issue 44, Q10


def test_deepep_api_ep_choice() -> None:
    ep = deepep_api_choice("v25", backend="deepep", elastic=None, ep=True)
    assert ep["api"] == "v25" and "deep_ep_v25.EPBuffer" in ep["reason"]
    missing = deepep_api_choice("v25", backend="deepep", elastic=True, ep=False)
    assert missing["api"] is None and "sgl-deep-ep-v25" in missing["reason"]
    worst = deepep_api_choice("auto", backend="deepep", elastic=True, num_worst_tokens=64, ep=True)
    assert worst["api"] == "v25" and "V2.5 deep_ep_v25.EPBuffer" in worst["reason"], worst
    dropless = deepep_api_choice("auto", backend="deepep", elastic=True, ep=True)
    assert dropless["api"] == "v1", dropless  # V1 takes any T


def test_run_doctor_with_ep_applies_v25_rules(capsys: pytest.CaptureFixture[str]) -> None:
    rep = run_doctor(world_size=16, ranks_per_node=4, deepep_api="v25", num_worst_tokens=64)
    checks = {c["name"]: c for c in rep["selection"]["checks"]["deepep"]}
    # 4 GPUs per node across nodes: V1 refuses that topology, DeepEP 2.5 takes it (hybrid)
    assert (
        checks["topology"]["ok"] and "hybrid mode over 4 nodes of 4" in checks["topology"]["detail"]
    )
    assert not checks["import"]["ok"] and rep["selection"]["backend"] == "torch"
    assert "deepep_api='v25'" in rep["selection"]["reason"]
    text = format_report(rep)
    assert "deepep gen V1 deep_ep.Buffer NO" in text and "V2.5 deep_ep_v25.EPBuffer NO" in text
    assert "  v2.5    " in text and "nvcc" in text
    assert (
        main(
            [
                "doctor",
                "--json",
                "--deepep-api",
                "v25",
                "--backend",
                "deepep",
                "--world-size",
                "2",
                "--ranks-per-node",
                "2",
            ]
        )
        == 1
    )
    out = json.loads(capsys.readouterr().out)
    assert out["selection"]["deepep_api"]["requested"] == "v25" and not out["ok"]
    assert {c["name"] for c in out["deep_ep_v25"]} >= {"nvcc", "cxx20", "nccl", "nccl_loaded"}
