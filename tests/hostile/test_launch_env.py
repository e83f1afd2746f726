"""The launch recipes check every variable they read before anything starts, and a hung peer under
torchrun ends the job within ``--timeout`` plus a few seconds (reliability-4 N23, N24, and the
single-node store's loopback note).

Each bad variable is one line on stderr naming it, exit 2, no traceback, and torchrun never runs
(a stand-in ``TORCHRUN`` that records its call). The collectives a hung peer could leave a rank in
(the demo's timing barrier, the router's global aux-loss and expert-bias all-reduces, the bench
barriers, the object exchange under a launcher) raise ``CollectiveError`` naming them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flexdispatch.distributed import CollectiveError
from tests.hostile import ROOT

pytestmark = pytest.mark.timeout(120)

LAUNCH = ROOT / "scripts" / "launch"
SINGLE, MULTI = LAUNCH / "torchrun_single_node.sh", LAUNCH / "torchrun_multi_node.sh"
SERVE = LAUNCH / "serve_hf_expert_parallel.sh"
_CLEAN = (
    "MASTER_PORT",
    "MASTER_ADDR",
    "NNODES",
    "NODE_RANK",
    "RANK",
    "WORLD_SIZE",
    "PYTHON",
    "RDZV_BACKEND",
    "RDZV_ENDPOINT",
    "RDZV_ID",
    "OMP_NUM_THREADS",
)


@pytest.fixture
def fake_torchrun(tmp_path: Path) -> Path:
    fake = tmp_path / "torchrun"
    # NOTE: it answers --help as torchrun does (the recipes check that TORCHRUN is torchrun)
    fake.write_text(
        "#!/usr/bin/env bash\n"
        '[[ "$1" == --help ]] && { echo "usage: [--nproc-per-node N]"; exit; }\n'
        'echo "TORCHRUN $* SHUTDOWN=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT-unset}'
        ' OMP=${OMP_NUM_THREADS-unset} AGENT=${FLEXDISPATCH_LAUNCHER_PID-unset} SELF=$$"\n'
    )
    fake.chmod(0o755)
    return fake


def _recipe(script: Path, fake: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in _CLEAN and not k.startswith("PET_")}
    base.update(NPROC_PER_NODE="2", FLEXDISPATCH_DEVICE="cpu", TORCHRUN=str(fake))
    return subprocess.run(
        ["bash", str(script), "--iters", "1"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


BAD = [
    (
        SINGLE,
        {"MASTER_PORT": "0"},
        "MASTER_PORT=0 is not a TCP port: pass an integer in [1, 65535]",
    ),
    (SINGLE, {"MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a TCP port"),
    (SINGLE, {"MASTER_PORT": "abc"}, "MASTER_PORT=abc is not a TCP port"),
    (SINGLE, {"PYTHON": "/bin/false"}, "PYTHON=/bin/false does not run Python 3.10+"),
    (SINGLE, {"PYTHON": "/no/python"}, "PYTHON=/no/python does not run Python 3.10+"),
    (SINGLE, {"FLEXDISPATCH_CMD": "nonexistent"}, "FLEXDISPATCH_CMD=nonexistent is not a"),
    (SINGLE, {"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE=0 is not a number of processes"),
    (SINGLE, {"NPROC_PER_NODE": "2x"}, "NPROC_PER_NODE=2x is not a number of processes"),
    (SINGLE, {"TORCHRUN": "no-such-torchrun"}, "TORCHRUN=no-such-torchrun is not a command"),
    (SINGLE, {"FLEXDISPATCH_DEVICE": "gpu"}, "FLEXDISPATCH_DEVICE=gpu is not a device choice"),
    (SINGLE, {"FLEXDISPATCH_DRY_RUN": "yes"}, "FLEXDISPATCH_DRY_RUN=yes must be 1"),
    (SINGLE, {"FLEXDISPATCH_VENV": "/no/venv"}, "FLEXDISPATCH_VENV=/no/venv is not a folder"),
    (SINGLE, {"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS=0 is not a number of threads"),
    (SINGLE, {"GLOO_SOCKET_IFNAME": "bogus0"}, "GLOO_SOCKET_IFNAME=bogus0 is not a network"),
    (SINGLE, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "x"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=x is not"),
    (SERVE, {"MASTER_PORT": "0"}, "MASTER_PORT=0 is not a TCP port"),
    (MULTI, {"MASTER_PORT": "0"}, "MASTER_PORT=0 is not a TCP port"),
    (MULTI, {"NNODES": "2", "FLEXDISPATCH_IFNAME": "bogus0"}, "FLEXDISPATCH_IFNAME=bogus0 is not"),
    (MULTI, {"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2 is not below NNODES=2"),
    (MULTI, {"NNODES": "0"}, "NNODES=0 is not a number of nodes"),
    (MULTI, {"MASTER_ADDR": "a b"}, "MASTER_ADDR=a\\ b is not a host name or address"),
    (MULTI, {"RDZV_BACKEND": "etcd"}, "RDZV_BACKEND=etcd must be static or c10d"),
    (MULTI, {"NNODES": "1:4"}, "NNODES=1:4 is not a number of nodes: pass an integer in"),
    (MULTI, {"RDZV_BACKEND": "c10d", "NNODES": "4:2"}, "NNODES=4:2 is not MIN:MAX nodes"),
    (MULTI, {"RDZV_BACKEND": "c10d", "NNODES": "0:2"}, "NNODES=0:2 is not MIN:MAX nodes"),
    (MULTI, {"MASTER_ADDR": "[fd00::1"}, "MASTER_ADDR=\\[fd00::1 is not a host name"),
    (
        MULTI,
        {"MASTER_ADDR": "10.0.0.1:29500"},
        "MASTER_ADDR=10.0.0.1:29500 is host:port: pass node 0's address alone and the port in "
        "MASTER_PORT",
    ),
    (MULTI, {"MASTER_ADDR": "a:b:c"}, "MASTER_ADDR=a:b:c is not a host name or address"),
    (
        MULTI,
        {"RDZV_BACKEND": "c10d", "MASTER_ADDR": "[fd00::1]:29500"},
        "MASTER_ADDR=\\[fd00::1\\]:29500 is host:port",
    ),
    (
        MULTI,
        {"RDZV_BACKEND": "c10d", "RDZV_ENDPOINT": "[fd00::1]:99999"},
        "RDZV_ENDPOINT=\\[fd00::1\\]:99999 is not a host:port endpoint",
    ),
    (SINGLE, {"OMP_NUM_THREADS": "4,0"}, "OMP_NUM_THREADS=4\\,0 is not a number of threads"),
    (SINGLE, {"OMP_NUM_THREADS": "4,"}, "OMP_NUM_THREADS=4\\, is not a number of threads"),
]


@pytest.mark.parametrize(
    ("script", "env", "message"), BAD, ids=[f"{s.stem}-{'-'.join(e)}" for s, e, _ in BAD]
)
def test_a_bad_variable_is_one_line_before_torchrun(script, env, message, fake_torchrun):
    proc = _recipe(script, fake_torchrun, **env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == "", "torchrun was started"
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"{script.name}: {message}"), proc.stderr


# NOTE: the environments that Slurm (slurm_flexdispatch.sbatch), a Kubeflow PyTorchJob (static,
# and elastic: the operator's PET_* variables) and torchrun's own elastic mode give the multi-node
# recipe, and what torchrun receives (the device check is stood in for: the cases above run it)
GOOD = [
    (
        "slurm",
        {"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "node-a", "MASTER_PORT": "29500"},
        "--nnodes 4 --node-rank 3 --rdzv-backend static --master-addr node-a --master-port 29500",
    ),
    (
        "kubeflow-static",
        {
            "PET_NNODES": "2",
            "PET_NODE_RANK": "1",
            "PET_NPROC_PER_NODE": "2",
            "MASTER_ADDR": "flexdispatch-demo-master-0",
            "MASTER_PORT": "23456",
        },
        "--nnodes 2 --node-rank 1 --rdzv-backend static --master-addr "
        "flexdispatch-demo-master-0 --master-port 23456",
    ),
    (
        "kubeflow-elastic",
        {
            "PET_NNODES": "2:4",
            "PET_RDZV_BACKEND": "c10d",
            "PET_RDZV_ENDPOINT": "flexdispatch-demo-master-0:23456",
            "PET_NPROC_PER_NODE": "2",
        },
        "--nnodes 2:4 --rdzv-backend c10d --rdzv-endpoint flexdispatch-demo-master-0:23456 "
        "--rdzv-id flexdispatch",
    ),
    (
        "torchrun-elastic",
        {"RDZV_BACKEND": "c10d", "NNODES": "1:4", "NODE_RANK": "7", "MASTER_ADDR": "10.0.0.1"},
        "--nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id flexdispatch",
    ),
    (
        "ipv6",
        {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "[fd00::1]", "OMP_NUM_THREADS": "4,2"},
        "--nnodes 2 --node-rank 1 --rdzv-backend static --master-addr [fd00::1] --master-port",
    ),
    (
        "ipv6-c10d",
        {"RDZV_BACKEND": "c10d", "NNODES": "2", "MASTER_ADDR": "fd00::1", "RDZV_ID": "job7"},
        "--nnodes 2 --rdzv-backend c10d --rdzv-endpoint [fd00::1]:29500 --rdzv-id job7",
    ),
]


@pytest.mark.parametrize(("env", "expected"), [g[1:] for g in GOOD], ids=[g[0] for g in GOOD])
def test_the_launchers_environments_reach_torchrun(env, expected, fake_torchrun, tmp_path):
    python = tmp_path / "python"
    python.write_text(
        '#!/usr/bin/env bash\n[[ "$1 $2" == "-m flexdispatch.launch.devices" ]] && exit 0\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    proc = _recipe(MULTI, fake_torchrun, PYTHON=str(python), **env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith(f"TORCHRUN {expected}"), proc.stdout
    omp = env.get("OMP_NUM_THREADS")
    assert omp is None or f"OMP={omp}" in proc.stdout
    agent, me = proc.stdout.split(" AGENT=")[1].split()
    assert me == f"SELF={agent}"  # NOTE: the agent's pid, for its workers (die_with_agent)


def test_single_node_recipe_bounds_the_shutdown_and_serves_its_store_on_loopback(fake_torchrun):
    from flexdispatch.launch import free_port

    port = free_port()
    proc = _recipe(SINGLE, fake_torchrun, MASTER_PORT=str(port))
    assert proc.returncode == 0, proc.stderr
    assert "SHUTDOWN=5" in proc.stdout  # NOTE: torchrun's own default grace is 30 s (N23)
    agent, me = proc.stdout.split(" AGENT=")[1].split()
    assert me == f"SELF={agent}"
    # NOTE: reliability-5 S11: torchrun joins the recipe's store on 127.0.0.1 as a client (its
    # own stores listened on every interface, which the recipe could only say in a note)
    rdzv = f"--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} --rdzv-conf is_host=false"
    assert rdzv in proc.stdout and "--local-addr 127.0.0.1" in proc.stdout, proc.stdout
    assert "every interface" not in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- guarded collectives


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _hung(*args, **kwargs):
    raise RuntimeError("[gloo] Timed out waiting 30000ms for recv operation to complete")


def test_router_collectives_name_themselves_when_a_peer_hangs(world_of_one, monkeypatch):
    import flexdispatch as fd

    cfg = fd.RouterConfig(
        num_experts=8, topk=2, aux_loss_type="global_aux_loss", aux_loss_coeff=0.01
    )
    router = fd.TopKRouter(cfg, 16, aux_loss_group=dist.group.WORLD)
    monkeypatch.setattr(dist, "all_reduce", _hung)
    with pytest.raises(CollectiveError, match=r"all_reduce \(global aux loss counts\) failed"):
        router(torch.randn(4, 16))
    bias_cfg = fd.RouterConfig(
        num_experts=8, topk=2, score_function="sigmoid", enable_expert_bias=True
    )
    biased = fd.TopKRouter(bias_cfg, 16)
    with pytest.raises(CollectiveError, match=r"all_reduce \(expert bias counts\) failed"):
        biased.update_expert_bias(dist.group.WORLD)


def test_demo_timing_barrier_names_itself_when_a_peer_hangs(world_of_one, monkeypatch):
    from flexdispatch.cli.demo import DemoSpec, run_rank

    monkeypatch.setattr(dist, "barrier", _hung)
    spec = DemoSpec(preset="tiny_cpu", backend="torch", tokens=4, seed=0, iters=1, worst_case=False)
    with pytest.raises(CollectiveError, match=r"barrier \(demo timing loop\) failed on rank 0"):
        run_rank(spec)


def test_launcher_object_exchange_names_itself_when_a_peer_hangs(world_of_one, monkeypatch):
    from flexdispatch.launch import broadcast_object, gather_objects

    assert gather_objects({"a": 1}) == [{"a": 1}]
    monkeypatch.setattr(dist, "all_gather", _hung)
    monkeypatch.setattr(dist, "broadcast", _hung)
    with pytest.raises(CollectiveError, match=r"all_gather \(object sizes\) failed"):
        gather_objects({"a": 1})
    with pytest.raises(CollectiveError, match=r"broadcast \(object size\) failed"):
        broadcast_object({"a": 1})


_WORKER = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "GROUP_RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
}


def _as_worker_of_this_process(monkeypatch, run_id: str) -> None:
    """Make this process a torchrun worker whose agent is ... this process (its children are
    then the agent's other workers): the worker variables, the recorded agent pid, the parent."""
    from flexdispatch.launch import lifetime

    for k, v in {**_WORKER, "TORCHELASTIC_RUN_ID": run_id}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(lifetime.LAUNCHER_PID_ENV, str(os.getpid()))
    monkeypatch.setattr(os, "getppid", os.getpid)


def _wait_stopped(*procs: subprocess.Popen, needle: bytes = b"") -> None:
    import signal

    from flexdispatch.launch.lifetime import _cmdline, _stat

    deadline = time.monotonic() + 30
    for p in procs:
        while needle not in b" ".join(_cmdline(p.pid) or []) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(p.pid, signal.SIGSTOP)
        while (_stat(p.pid) or ("?",))[0] not in "Tt" and time.monotonic() < deadline:
            time.sleep(0.02)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_failing_rank_ends_the_stopped_workers_of_its_job(monkeypatch):
    # NOTE: N23: a SIGSTOPped worker ignores torchrun's SIGTERM; torchrun waits 30 s (whatever
    # TORCH_ELASTIC_SHUTDOWN_TIMEOUT says, for a failed worker group) before its SIGKILL. This
    # process stands in for the torchrun agent (and for the failing worker): the "workers" are
    # its children. S1: only stopped flexdispatch workers of the same run are ended.
    import signal

    from flexdispatch.launch import end_stopped_local_peers

    def worker(run_id: str, *argv: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(ROOT), **_WORKER, "TORCHELASTIC_RUN_ID": run_id}
        cmd = list(argv) or [sys.executable, "-m", "flexdispatch.cli", "presets"]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    hung, running, other_job = worker("job1"), worker("job1", "sleep", "60"), worker("job2")
    not_ours = worker("job1", "sleep", "60")  # NOTE: same run id, stopped, not flexdispatch
    try:
        _wait_stopped(hung, other_job, needle=b"flexdispatch.cli")
        _wait_stopped(not_ours, needle=b"sleep")
        # NOTE: not a worker (no recorded agent, a parent that is not torchrun): nothing
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
        assert end_stopped_local_peers() == []
        _as_worker_of_this_process(monkeypatch, "job1")
        ended = end_stopped_local_peers()
        assert ended == [hung.pid]
        assert hung.wait(timeout=10) == -signal.SIGKILL
        assert all(p.poll() is None for p in (running, other_job, not_ours))
    finally:
        for p in (hung, running, other_job, not_ours):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(OSError):
                    os.kill(p.pid, sig)
            p.wait()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_fork_of_the_agent_stopped_before_its_exec_is_ended(monkeypatch):
    # NOTE: torchrun forks each worker: one stopped between the fork and its exec has neither the
    # run id in its environment nor flexdispatch in its command line, only the agent's own
    # executable and command line (here: this process's)
    import signal

    from flexdispatch.launch import end_stopped_local_peers

    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        from flexdispatch.launch.lifetime import _stat

        while (_stat(pid) or ("?",))[0] not in "Tt" and time.monotonic() < deadline:
            time.sleep(0.01)
        _as_worker_of_this_process(monkeypatch, "job1")
        assert end_stopped_local_peers() == [pid]
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def test_a_torchrun_worker_ends_with_its_agent(monkeypatch, capsys, tmp_path):
    # NOTE: a SIGKILLed torchrun left its workers running (reliability-4 section 5): the command
    # line arms the parent-death signal of tests/hostile/test_processes.py in a torchrun worker
    # (the worker variables, and a parent that is the recorded agent or runs torchrun), and a
    # worker whose agent (the pid the recipes record) ended before that exits at once. A process
    # that merely inherited the variables is tied to nothing (S1).
    import flexdispatch.launch.lifetime as lifetime
    from flexdispatch.cli import main

    armed: list[int] = []
    monkeypatch.setattr(lifetime, "die_with_parent", armed.append)
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "WARNING")  # NOTE: main sets it under a launcher
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv(lifetime.LAUNCHER_PID_ENV, raising=False)
    assert main(["presets"]) == 0 and armed == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    assert main(["presets"]) == 0 and armed == []  # NOTE: an inherited run id alone
    for k, v in _WORKER.items():
        monkeypatch.setenv(k, v)
    assert main(["presets"]) == 0 and armed == []  # NOTE: pytest's parent is not torchrun
    monkeypatch.setenv(lifetime.LAUNCHER_PID_ENV, str(os.getppid()))
    assert main(["presets"]) == 0 and armed == [os.getppid()]
    armed.clear()
    monkeypatch.setenv(lifetime.LAUNCHER_PID_ENV, str(os.getpid()))  # NOTE: running, not the parent
    assert main(["presets"]) == 0 and armed == []
    monkeypatch.delenv(lifetime.LAUNCHER_PID_ENV)
    torchrun = [b"/venv/bin/python3", b"/venv/bin/torchrun", b"--nproc-per-node", b"2"]
    for argv in (torchrun, [b"python", b"-m", b"torch.distributed.run", b"x.py"]):
        monkeypatch.setattr(lifetime, "_cmdline", lambda pid, argv=argv: argv)
        armed.clear()
        assert main(["presets"]) == 0 and armed == [os.getppid()]
    monkeypatch.undo()
    for k, v in {**_WORKER, "TORCHELASTIC_RUN_ID": "job1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(lifetime, "die_with_parent", armed.append)
    capsys.readouterr()
    ended = subprocess.Popen(["true"])
    ended.wait()
    zombie = subprocess.Popen(["true"])  # NOTE: not waited for: a SIGKILLed, unreaped agent
    deadline = time.monotonic() + 10
    while not lifetime._gone(zombie.pid) and time.monotonic() < deadline:
        time.sleep(0.01)

    def exits(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(lifetime.os, "_exit", exits)
    for gone in (ended.pid, zombie.pid):
        monkeypatch.setenv(lifetime.LAUNCHER_PID_ENV, str(gone))
        armed.clear()
        with pytest.raises(SystemExit) as info:
            lifetime.die_with_agent()
        assert info.value.code == 1 and armed == []
        err = capsys.readouterr().err
        assert f"the torchrun agent (pid {gone}, $FLEXDISPATCH_LAUNCHER_PID) ended before" in err
    zombie.wait()
