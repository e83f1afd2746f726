"""The launch recipes in scripts/launch/ on this CPU machine.

- ``torchrun_single_node.sh`` runs ``flexdispatch demo`` (its store on ``MASTER_PORT``, every
  listening socket of the job on 127.0.0.1) and ``bench`` (a free port) with two gloo ranks;
- ``torchrun_multi_node.sh`` runs as two agents on 127.0.0.1 (2 nodes x 2 ranks, static
  rendezvous), and ``flexdispatch demo`` must see 2 nodes from the launcher's environment;
- ``slurm_flexdispatch.sbatch`` passes ``bash -n`` and, with stand-ins for ``scontrol`` and
  ``srun``, starts one agent per node with the right node rank and master address;
- ``k8s_pytorchjob.yaml`` parses, and its container command picks the node rank the operator
  exports.

Every subprocess has a timeout. Shape letters: R ranks · L ranks per node · N nodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flexdispatch.launch import free_port
from tests.dist.harness import run_agents

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch"
SINGLE = LAUNCH / "torchrun_single_node.sh"
MULTI = LAUNCH / "torchrun_multi_node.sh"
SBATCH = LAUNCH / "slurm_flexdispatch.sbatch"
K8S = LAUNCH / "k8s_pytorchjob.yaml"
DEMO_ARGS = ["--iters", "1", "--tokens", "32"]
_LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NNODES",
    "NODE_RANK",
    "NPROC_PER_NODE",
    "FLEXDISPATCH_CMD",
    "FLEXDISPATCH_DRY_RUN",
    "RDZV_BACKEND",
    "TORCHRUN",
    "FLEXDISPATCH_DEVICE",
    "FLEXDISPATCH_VISIBLE_GPUS",
)
# NOTE: the runs below are gloo runs on the CPU, whatever GPUs the machine has (the recipes hide
# them from the workers); the dry runs fake 8 GPUs so that the device check passes everywhere.
CPU = {"FLEXDISPATCH_DEVICE": "cpu"}
LOOPBACK4 = "0100007F"  # NOTE: 127.0.0.1 as /proc/net/tcp writes it


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV and not k.startswith("PET_")
    }
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _demo_summary(text: str) -> tuple[int, int, int]:
    m = re.search(r"(\d+) node\(s\) × (\d+) rank\(s\) = (\d+) ranks", text)
    assert m, text[-3000:]
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def _tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    kids: dict[int, list[int]] = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                stat = Path(f"/proc/{e}/stat").read_text()
            except OSError:
                continue
            kids.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(e))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def _run_watching_listeners(cmd: list[str], env: dict[str, str], timeout: float = 150):
    """``cmd`` run to its end, and every (address hex, port) its process tree listened on (TCP,
    sampled every 50 ms)."""
    from tests.hostile.test_security import _listening

    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen: set[tuple[str, int]] = set()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                seen.update((addr, port) for _, addr, port in _listening(_tree(proc.pid)))
            time.sleep(0.05)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), seen


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_single_node_demo_under_torchrun_listens_on_loopback_only() -> None:
    # NOTE: reliability-5 S11: torchrun's stores listened on every interface (*:PORT, twice);
    # the recipe now serves the rendezvous store on 127.0.0.1 and flexdispatch binds the
    # workers' store there (join_launcher_group)
    env = _env(NPROC_PER_NODE="2", MASTER_PORT=str(free_port()), **CPU)
    proc, listeners = _run_watching_listeners(["bash", str(SINGLE), *DEMO_ARGS], env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert (LOOPBACK4, int(env["MASTER_PORT"])) in listeners, listeners  # the recipe's store
    assert {addr for addr, _ in listeners} == {LOOPBACK4}, listeners
    assert _demo_summary(proc.stdout) == (1, 2, 2)
    assert "check vs single-process reference" in proc.stdout and ": OK (" in proc.stdout
    assert proc.stdout.count("flexdispatch demo —") == 1  # rank 0 prints, rank 1 does not


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_single_node_bench_standalone() -> None:
    env = _env(NPROC_PER_NODE="2", FLEXDISPATCH_CMD="bench", **CPU)
    args = ["--json", "--tokens", "32", "--hidden", "16", "--experts", "4", "--topk", "2"]
    proc = _run(["bash", str(SINGLE), *args, "--reps", "2", "--warmup", "0"], env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(proc.stdout)
    assert report["machine"]["launcher"] == "torchrun"
    assert report["machine"]["process_group"] == "gloo"
    assert report["config"]["world_size"] == 2 and report["config"]["ranks_per_node"] == 2
    assert [r["stage"] for r in report["results"]] == [
        "router",
        "layout",
        "permute",
        "dispatch",
        "combine",
    ]


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_multi_node_script_two_agents() -> None:
    port = str(free_port())
    agents, outputs = run_agents(
        [["bash", str(MULTI), *DEMO_ARGS]] * 2,
        envs=[
            _env(
                NNODES="2",
                NODE_RANK=str(node),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                NPROC_PER_NODE="2",
                **CPU,
            )
            for node in (0, 1)
        ],
        cwd=str(ROOT),
        timeout=200,
    )
    text = "\n".join(outputs)
    assert all(a.returncode == 0 for a in agents), text[-4000:]
    assert _demo_summary(outputs[0]) == (2, 2, 4)
    assert "flexdispatch demo —" not in outputs[1]  # global rank 0 lives on node 0
    assert ": OK (" in outputs[0]
    flat = re.search(r"^flat\s+\S+ \S+\s+(\S+) (\S+)", outputs[0], re.MULTILINE)
    assert flat and flat.group(1) != "0", outputs[0]  # bytes crossed the node boundary


def _dry_run(script: Path, env: dict[str, str], *args: str) -> list[str]:
    env = {"FLEXDISPATCH_VISIBLE_GPUS": "8", **env, "FLEXDISPATCH_DRY_RUN": "1"}
    proc = _run(["bash", str(script), *args], env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def _opt(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_multi_node_script_options() -> None:
    base = _env(NNODES="4", NODE_RANK="3", MASTER_ADDR="10.1.2.3", MASTER_PORT="29999")
    argv = _dry_run(MULTI, {**base, "NPROC_PER_NODE": "8"}, "--tokens", "8")
    assert (_opt(argv, "--nnodes"), _opt(argv, "--node-rank")) == ("4", "3")
    assert (_opt(argv, "--master-addr"), _opt(argv, "--master-port")) == ("10.1.2.3", "29999")
    assert _opt(argv, "--rdzv-backend") == "static" and _opt(argv, "--nproc-per-node") == "8"
    assert argv[-5:] == ["-m", "flexdispatch.cli", "demo", "--tokens", "8"]
    c10d = _dry_run(MULTI, {**base, "RDZV_BACKEND": "c10d", "FLEXDISPATCH_CMD": "bench"})
    assert _opt(c10d, "--rdzv-endpoint") == "10.1.2.3:29999" and "--node-rank" not in c10d
    assert c10d[-1] == "bench"
    pet = _dry_run(MULTI, _env(PET_NNODES="2", PET_NODE_RANK="1", PET_NPROC_PER_NODE="4"))
    assert (_opt(pet, "--nnodes"), _opt(pet, "--node-rank")) == ("2", "1")
    assert _opt(pet, "--nproc-per-node") == "4"
    custom = _dry_run(MULTI, _env(TORCHRUN=f"{sys.executable} -m torch.distributed.run"))
    assert custom[:3] == [sys.executable, "-m", "torch.distributed.run"]
    bad = _run(["bash", str(MULTI)], _env(RDZV_BACKEND="etcd"), timeout=30)
    assert bad.returncode == 2 and "RDZV_BACKEND=etcd must be static or c10d" in bad.stderr
    single = _dry_run(SINGLE, _env(NPROC_PER_NODE="3"))
    assert _opt(single, "--rdzv-backend") == "c10d" and _opt(single, "--nproc-per-node") == "3"
    assert _opt(single, "--rdzv-endpoint") == "127.0.0.1:PORT"  # NOTE: the recipe's own store
    assert _opt(single, "--rdzv-conf") == "is_host=false"


@pytest.mark.timeout(120)
def test_recipes_refuse_more_ranks_than_gpus_before_torchrun(tmp_path: Path) -> None:
    """NPROC_PER_NODE > the GPUs visible: one line naming both and what to pass, exit 2, torchrun
    never started; FLEXDISPATCH_DEVICE=cpu runs gloo with the GPUs hidden from the workers."""
    fake = tmp_path / "fake_torchrun"
    fake.write_text(  # NOTE: it answers --help as torchrun does (the recipes check TORCHRUN)
        "#!/usr/bin/env bash\n"
        '[[ "$1" == --help ]] && { echo "usage: [--nproc-per-node N]"; exit; }\n'
        'echo "CUDA_VISIBLE_DEVICES=[${CUDA_VISIBLE_DEVICES-unset}]"\n'
    )
    fake.chmod(0o755)
    serve = LAUNCH / "serve_hf_expert_parallel.sh"
    for script, extra in ((SINGLE, {}), (MULTI, {"NNODES": "1"}), (serve, {})):
        env = _env(NPROC_PER_NODE="2", FLEXDISPATCH_VISIBLE_GPUS="1", TORCHRUN=str(fake), **extra)
        proc = _run(["bash", str(script), "ckpt"], env, timeout=60)
        assert proc.returncode == 2 and proc.stdout == "", (script.name, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, (script.name, proc.stderr)
        assert "2 rank(s) on this machine but only 1 GPU(s) visible" in lines[0]
        assert "NPROC_PER_NODE=1" in lines[0] and "FLEXDISPATCH_DEVICE=cpu" in lines[0]
        proc = _run(["bash", str(script), "ckpt"], {**env, **CPU}, timeout=60)
        assert proc.returncode == 0, (script.name, proc.stderr)
        assert "CUDA_VISIBLE_DEVICES=[]" in proc.stdout, (script.name, proc.stdout)
        assert "gloo" in proc.stderr
        fits = _run(["bash", str(script), "ckpt"], {**env, "NPROC_PER_NODE": "1"}, timeout=60)
        assert fits.returncode == 0 and "NCCL, one rank per GPU" in fits.stderr, fits.stderr
        kept = env.get("CUDA_VISIBLE_DEVICES", "unset")  # the GPUs are left as they were
        assert f"CUDA_VISIBLE_DEVICES=[{kept}]" in fits.stdout, fits.stdout


def test_slurm_batch_script(tmp_path: Path) -> None:
    assert _run(["bash", "-n", str(SBATCH)], _env(), timeout=30).returncode == 0
    text = SBATCH.read_text()
    assert re.search(r"^#SBATCH --ntasks-per-node=1$", text, re.MULTILINE)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] || exit 3\n'
        'printf "node-a\\nnode-b\\n"\n'
    )
    # srun stand-in: one task per node, SLURM_NODEID 0..N-1, options before the command skipped
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        'while [[ "$1" == --* ]]; do shift; done\n'
        'for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do SLURM_NODEID=$i "$@" || exit 1; done\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = _env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_NODELIST="node-[a-b]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_GPUS_ON_NODE="8",
        SLURM_SUBMIT_DIR=str(ROOT),
        FLEXDISPATCH_DRY_RUN="1",
        FLEXDISPATCH_VISIBLE_GPUS="8",  # the allocation's nodes, not this machine
    )
    proc = _run(["bash", str(SBATCH), "--tokens", "16"], env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    commands = [shlex.split(line) for line in proc.stdout.splitlines() if "torchrun" in line]
    assert len(commands) == 2, proc.stdout
    for node, argv in enumerate(commands):
        assert _opt(argv, "--node-rank") == str(node)
        assert (_opt(argv, "--nnodes"), _opt(argv, "--master-addr")) == ("2", "node-a")
        assert _opt(argv, "--nproc-per-node") == "8"
        assert argv[-4:] == ["flexdispatch.cli", "demo", "--tokens", "16"]


def test_k8s_manifest() -> None:
    docs = list(yaml.safe_load_all(K8S.read_text()))
    assert len(docs) == 1
    job = docs[0]
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    nodes = specs["Master"]["replicas"] + specs["Worker"]["replicas"]
    for role in ("Master", "Worker"):
        pod = specs[role]["template"]["spec"]
        (c,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
        assert c["image"] == "flexdispatch:latest"
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["NNODES"] == str(nodes) and env["FLEXDISPATCH_CMD"] == "demo"
        assert int(env["NPROC_PER_NODE"]) == c["resources"]["limits"]["nvidia.com/gpu"]
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        vols = {v["name"]: v for v in pod["volumes"]}
        shm = [n for n, p in mounts.items() if p == "/dev/shm"]
        assert shm and vols[shm[0]]["emptyDir"]["medium"] == "Memory"
        # the container command, run here: the node rank comes from the operator's variables
        script = " ".join(c["args"])
        assert "scripts/launch/torchrun_multi_node.sh" in script
        for operator_env, rank in (({"PET_NODE_RANK": "1"}, "1"), ({"RANK": "1"}, "1"), ({}, "0")):
            gpus = str(c["resources"]["limits"]["nvidia.com/gpu"])  # the pod's GPUs
            run_env = _env(
                **env, **operator_env, FLEXDISPATCH_DRY_RUN="1", FLEXDISPATCH_VISIBLE_GPUS=gpus
            )
            proc = _run([*c["command"], script], run_env, timeout=30)
            assert proc.returncode == 0, proc.stderr
            argv = shlex.split(proc.stdout)
            assert _opt(argv, "--node-rank") == rank
            assert _opt(argv, "--nnodes") == str(nodes) and argv[-1] == "demo"
