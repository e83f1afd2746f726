"""``flexdispatch doctor``'s DeepEP part: which generations import, and DeepEP 2.5's run-time needs.

DeepEP 2.5 (``deep_ep_v25``, SGLang's wheel ``sgl-deep-ep-v25``) compiles its kernels when they are
first used (DeepJIT), so a machine needs, at run time, what only a build machine needs for V1 / V2:
a CUDA 13 torch, ``nvcc`` >= 13.1 (found as DeepEP finds it: ``EP_JIT_NVCC_COMPILER``,
``DJ_JIT_NVCC_COMPILER``, ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, ``PATH``,
``/usr/local/cuda/bin``), a C++20 host compiler, NCCL >= 2.32.3 with its headers
(``EP_NCCL_ROOT_DIR``, ``NCCL_DIR`` or the ``nvidia-nccl-cu13`` wheel) — and exactly that NCCL
loaded in the process (its import checks the loaded library against that one) — plus ``ibstat``
and ``nvidia-smi``, which its SM / QP model reads (the NIC type and rate, the NVLink bandwidth).
Each check names its fix; every probe answers without raising.
"""

from __future__ import annotations

import filecmp
import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MIN_NCCL",
    "MIN_NVCC",
    "WHEEL_V25",
    "ep_selection",
    "probe_generations",
    "probe_v25_runtime",
]

WHEEL_V25 = "sgl-deep-ep-v25==0.1.0rc0"
MIN_NVCC = (13, 1)
MIN_NCCL = (2, 32, 3)
_CXX20 = "#include <concepts>\ntemplate <std::integral T> T f(T x) { return x; }\nint main() {}\n"

Run = Callable[..., Any]


def probe_generations(deep_ep: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Which DeepEP generations import here: V1 ``deep_ep.Buffer``, V2 ``deep_ep.ElasticBuffer``
    (both from ``probe_deep_ep``'s answer ``deep_ep``), V2.5 ``deep_ep_v25.EPBuffer``."""
    from flexdispatch.backends.deepep.v25.support import load_deep_ep_v25, v25_available

    module, why = load_deep_ep_v25()
    ok, why = v25_available(module, why)
    v1_ok = bool(deep_ep.get("usable"))
    v2_ok = v1_ok and bool(deep_ep.get("elastic"))
    return {
        "v1": {"ok": v1_ok, "api": "deep_ep.Buffer", "reason": deep_ep.get("reason", "")},
        "v2": {
            "ok": v2_ok,
            "api": "deep_ep.ElasticBuffer",
            "reason": "deep_ep has ElasticBuffer"
            if v2_ok
            else (deep_ep.get("reason", "") if not v1_ok else "this deep_ep has no ElasticBuffer"),
        },
        "v25": {
            "ok": ok,
            "api": "deep_ep_v25.EPBuffer",
            "reason": why,
            "version": getattr(module, "__version__", None) if module is not None else None,
            "wheel": _dist_version("sgl-deep-ep-v25"),
        },
    }


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _check(name: str, ok: bool, detail: str, fix: str = "", level: str = "error") -> dict:
    return {"name": name, "ok": ok, "detail": detail, "fix": "" if ok else fix, "level": level}


def _find_nvcc(env: Mapping[str, str], which: Callable[[str], str | None]) -> str:
    """DeepEP 2.5's discovery order (``deep_ep_v25/prerequisites.py``)."""
    for name in ("EP_JIT_NVCC_COMPILER", "DJ_JIT_NVCC_COMPILER"):
        if env.get(name):
            return env[name]
    for name in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(name):
            return str(Path(env[name]) / "bin" / "nvcc")
    return which("nvcc") or "/usr/local/cuda/bin/nvcc"


def _nccl_root(env: Mapping[str, str]) -> str | None:
    """DeepEP 2.5's NCCL root: ``EP_NCCL_ROOT_DIR``, ``NCCL_DIR`` or an ``nvidia-nccl-*`` wheel."""
    for name in ("EP_NCCL_ROOT_DIR", "NCCL_DIR"):
        if env.get(name):
            return env[name]
    for dist in importlib.metadata.distributions():
        if not (dist.metadata["Name"] or "").lower().startswith("nvidia-nccl"):
            continue
        for f in dist.files or []:
            if "libnccl.so" in str(f):
                lib = os.path.dirname(str(f.locate()))
                return os.path.dirname(lib) if os.path.basename(lib) == "lib" else lib
    return None


def _run(run: Run, cmd: list[str], **kw: Any) -> tuple[int, str]:
    try:
        p = run(cmd, capture_output=True, text=True, timeout=20, **kw)
    except (OSError, subprocess.SubprocessError) as exc:
        return -1, f"{type(exc).__name__}: {exc}"
    return p.returncode, (p.stdout or "") + (p.stderr or "")


def _version(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def probe_v25_runtime(
    *,
    env: Mapping[str, str] | None = None,
    which: Callable[[str], str | None] = shutil.which,
    run: Run = subprocess.run,
    maps: str = "/proc/self/maps",
    torch_cuda: str | None = None,
    nccl_loaded: tuple[int, ...] | None = None,
    links: Callable[[], tuple[float, float, bool] | None] | None = None,
) -> list[dict[str, Any]]:
    """DeepEP 2.5's run-time needs, each ``{name, ok, detail, fix, level}`` (``level`` "error":
    it cannot run; "warning": it runs, on a default or after a fix).

    Args:
        env, which, run, maps: the environment, ``shutil.which``, ``subprocess.run`` and the
            process's memory map (stand-ins in tests).
        torch_cuda: torch's CUDA version (default ``torch.version.cuda``).
        nccl_loaded: the NCCL version this process loaded (default: torch's, when it has CUDA).
        links: DeepEP 2.5's own link probes, ``(NVLink GB/s, RDMA GB/s, fast atomics)`` with 0 /
            False for a failure, or None when they cannot run (default: ``v25.links.probe_links``
            where ``deep_ep_v25`` imports).
    """
    env = os.environ if env is None else env
    torch_cuda = torch.version.cuda if torch_cuda is None else torch_cuda
    out = []
    wheel = _dist_version("sgl-deep-ep-v25")
    out.append(
        _check(
            "wheel",
            wheel is not None,
            f"sgl-deep-ep-v25 {wheel}" if wheel else "not installed",
            f"pip install --no-deps {WHEEL_V25} (never without --no-deps: it pins a CUDA torch)",
        )
    )
    major = (torch_cuda or "").split(".")[0]
    out.append(
        _check(
            "torch_cuda",
            major == "13",
            f"torch built with CUDA {torch_cuda or 'none'}",
            "install the CUDA 13 build of torch==2.14.1 (--index-url "
            "https://download.pytorch.org/whl/cu130), the one the wheel pins",
        )
    )
    nvcc = _find_nvcc(env, which)
    rc, text = _run(run, [nvcc, "--version"])
    m = re.search(r"release (\d+)\.(\d+)", text)
    got = (int(m.group(1)), int(m.group(2))) if m and rc == 0 else None
    ok = got is not None and got[0] == MIN_NVCC[0] and got[1] >= MIN_NVCC[1]
    out.append(
        _check(
            "nvcc",
            ok,
            f"{nvcc}: " + (f"CUDA {got[0]}.{got[1]}" if got else "not usable"),
            "install a CUDA 13.1+ toolkit and put its nvcc on PATH (or set CUDA_HOME or "
            "EP_JIT_NVCC_COMPILER): DeepEP 2.5 compiles its kernels at first use",
        )
    )
    cxx = env.get("CXX") or next((c for c in ("c++", "g++", "clang++") if which(c)), None)
    if cxx is None:
        out.append(
            _check(
                "cxx20",
                False,
                "no C++ compiler (CXX, c++, g++, clang++)",
                "apt-get install g++ (GCC >= 10) or set CXX",
            )
        )
    else:
        rc, text = _run(run, [cxx, "-std=c++20", "-x", "c++", "-fsyntax-only", "-"], input=_CXX20)
        out.append(
            _check(
                "cxx20",
                rc == 0,
                f"{cxx} " + ("compiles C++20" if rc == 0 else "rejects -std=c++20"),
                "install GCC >= 10 or clang >= 10 (apt-get install g++) or point CXX at one",
            )
        )
    out.extend(_nccl_checks(env, maps, nccl_loaded))
    for tool, why, pkg in (
        (
            "ibstat",
            "the NIC type (fast RDMA atomics: 65 QPs, else 129) and rate (RDMA GB/s)",
            "infiniband-diags",
        ),
        (
            "nvidia-smi",
            "the NVLink bandwidth (nvidia-smi nvlink -s) for its SM count",
            "the NVIDIA driver utilities",
        ),
    ):
        path = which(tool)
        out.append(
            _check(
                tool,
                path is not None,
                path or "not on PATH",
                f"install {pkg}: DeepEP 2.5 reads {why}; without it flexdispatch uses a "
                f"documented default (or set DispatchConfig.deepep_num_sms)",
                level="warning",
            )
        )
    out.append(_links_check(links() if links is not None else _probe_links()))
    out.append(_gin_check(env, nccl_loaded))
    return out


def _probe_links() -> tuple[float, float, bool] | None:
    from flexdispatch.backends.deepep.v25.links import probe_links
    from flexdispatch.backends.deepep.v25.support import load_deep_ep_v25

    module, _ = load_deep_ep_v25()
    if module is None or getattr(module, "EPBuffer", None) is None:
        return None
    return probe_links(module, rdma=True)


def _links_check(probed: tuple[float, float, bool] | None) -> dict[str, Any]:
    """What DeepEP 2.5's link probes measured and what flexdispatch's SM / QP model uses."""
    from flexdispatch.backends.deepep.v25.links import choose_links

    fix = (
        "for measured values install the NVIDIA driver utilities (nvidia-smi) and "
        "infiniband-diags (ibstat, CA mlx5_0), or set DispatchConfig.deepep_num_sms"
    )
    if probed is None:
        chosen = choose_links(0.0, 0.0, False, hybrid=True, rdma=True)
        detail = f"not probed (deep_ep_v25 does not import here); would use {chosen.detail}"
        return _check("links", False, detail, fix, level="warning")
    nvl, rd, atomics = probed
    chosen = choose_links(nvl, rd, atomics, hybrid=True, rdma=True)
    detail = (
        f"probed NVLink {nvl:g} GB/s, RDMA {rd:g} GB/s, fast RDMA atomics {atomics}; uses "
        f"{chosen.detail} (hybrid mode; direct mode 17 QPs), agreed across ranks at the first "
        f"dispatch, for DeepEP 2.5's SM count unless DispatchConfig.deepep_num_sms is set"
    )
    return _check("links", nvl > 0 and rd > 0, detail, fix, level="warning")


def _gin_check(env: Mapping[str, str], nccl_loaded: tuple[int, ...] | None) -> dict[str, Any]:
    """DeepEP V2 / 2.5's NCCL preconditions at buffer creation (issue 44: the whole set)."""
    from flexdispatch.backends.deepep.gin import gin_disabled

    if gin_disabled(env):
        return _check(
            "gin",
            True,
            "EP_DISABLE_GIN set: DeepEP V2 / 2.5 skip their GIN checks (on one node only: across "
            "nodes selection refuses it; NCCL's device API is still needed)",
            "",
        )
    reported = nccl_loaded is None or tuple(nccl_loaded) >= (2, 29, 4)
    detail = (
        "DeepEP V2 / 2.5 need NCCL's device API (symmetric memory) and a GIN type (2.5: with "
        "GDAKI support) when they build their buffer, also on one node; backend selection asks "
        "NCCL (ncclCommQueryProperties on the group's communicator, as each generation asks) and "
        "falls back with the reason; the doctor's 'gin' field says what the environment "
        "already turns off"
        + ("" if reported else f"; NCCL {_version(tuple(nccl_loaded or ()))} does not report it")
    )
    fix = (
        "NCCL >= 2.29.4 reports the GIN type; on one node without GIN set EP_DISABLE_GIN=1 "
        "(docs/deepep.md)"
    )
    return _check("gin", reported, detail, fix, level="warning")


def _nccl_checks(
    env: Mapping[str, str], maps: str, nccl_loaded: tuple[int, ...] | None
) -> list[dict[str, Any]]:
    """NCCL >= 2.32.3 with headers where DeepEP looks, and the same library loaded here."""
    out = []
    root = _nccl_root(env)
    fix = (
        'pip install --no-deps "nvidia-nccl-cu13>=2.32.3" (over the one torch pins) or set '
        "EP_NCCL_ROOT_DIR to an NCCL >= 2.32.3 with include/nccl.h"
    )
    header = Path(root) / "include" / "nccl.h" if root else None
    linked = None
    if header is not None and header.is_file():
        found = dict(
            re.findall(
                r"^#define NCCL_(MAJOR|MINOR|PATCH)\s+(\d+)", header.read_text(), re.MULTILINE
            )
        )
        if len(found) == 3:
            linked = tuple(int(found[k]) for k in ("MAJOR", "MINOR", "PATCH"))
    detail = f"{root or 'no NCCL root'}: " + (_version(linked) if linked else "no nccl.h")
    out.append(_check("nccl", linked is not None and linked >= MIN_NCCL, detail, fix))
    if nccl_loaded is None and torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl_loaded = v if isinstance(v, tuple) else None
        except Exception:  # a broken NCCL must not break the doctor
            nccl_loaded = None
    loaded_files = []
    try:
        with open(maps) as f:
            loaded_files = sorted({ln.split()[-1] for ln in f if "libnccl" in ln})
    except OSError:
        pass
    libs = sorted(glob.glob(f"{root}/lib/libnccl.so*")) if root else []
    same = None
    if loaded_files and libs:
        same = len(loaded_files) == 1 and filecmp.cmp(loaded_files[0], libs[0], shallow=False)
    detail = (
        f"loaded {', '.join(loaded_files) or 'none yet'}"
        + (f" ({_version(nccl_loaded)})" if nccl_loaded else "")
        + f"; DeepEP's {libs[0] if libs else 'none'}"
        + (f" ({_version(linked)})" if linked else "")
    )
    ok = same is not False and (nccl_loaded is None or linked is None or nccl_loaded == linked)
    out.append(
        _check(
            "nccl_loaded",
            ok,
            detail,
            "make the NCCL torch loads the one DeepEP compiles against (install it with "
            '--no-deps "nvidia-nccl-cu13==<version>", or point EP_NCCL_ROOT_DIR at the loaded '
            "one); DeepEP 2.5 refuses to import otherwise (EP_SUPPRESS_NCCL_CHECK=1 skips that)",
        )
    )
    return out


def ep_selection(
    requested: str, R: int, L: int, facts: Any, v25: Mapping[str, Any], num_worst_tokens: int = 0
) -> tuple[str | None, str, list[dict[str, Any]]]:
    """What ``backend=requested`` with ``deepep_api='v25'`` would run on R ranks with L per node:
    DeepEP 2.5's own rules (``v25_rules``; E taken as R, any multiple of R passes), not V1's.

    Returns:
        ``(backend or None, reason, checks)``, checks as ``{name, ok, detail}``.
    """
    from flexdispatch.backends.deepep.v25.support import v25_rules

    ok_t, why_t, _ = v25_rules(R, L, R, num_worst_tokens=num_worst_tokens)
    checks = [
        {"name": "import", "ok": bool(v25["ok"]), "detail": v25["reason"]},
        {
            "name": "cuda",
            "ok": facts.cuda_available,
            "detail": "CUDA is available" if facts.cuda_available else "CUDA is not available",
        },
        {
            "name": "nccl",
            "ok": facts.nccl_available,
            "detail": "torch has NCCL" if facts.nccl_available else "torch was built without NCCL",
        },
        {
            "name": "gpus",
            "ok": facts.num_gpus >= L,
            "detail": f"{facts.num_gpus} GPU(s) here for {L} rank(s) per node",
        },
        {"name": "topology", "ok": ok_t, "detail": why_t},
    ]
    fail = next((c for c in checks if not c["ok"]), None)
    if fail is None:
        return "deepep", f"deepep with DeepEP 2.5 ({why_t})", checks
    if requested == "deepep":
        return None, f"deepep backend with deepep_api='v25' not available: {fail['detail']}", checks
    return "torch", f"auto: torch fallback (deepep_api='v25': {fail['detail']})", checks
