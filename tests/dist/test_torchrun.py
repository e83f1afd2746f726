"""Two ``torchrun`` agents (2 nodes x 2 ranks, static rendezvous on 127.0.0.1) run the worker.

Checks that a hierarchical dispatcher built without ``ranks_per_node`` finds L = 2 from the
launcher's ``LOCAL_WORLD_SIZE`` (so N = 2 nodes) and that a round trip is correct on every rank.
Shape letters: R ranks · L ranks per node · N nodes.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.dist.harness import free_port, run_agents

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("torchrun_worker.py")


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_torchrun_two_nodes_detects_local_world_size() -> None:
    port = free_port()
    env = dict(os.environ)
    env.pop("LOCAL_WORLD_SIZE", None)
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
    )
    agents, outputs = run_agents(
        [
            [
                *_torchrun(),
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--rdzv-backend",
                "static",
                "--max-restarts",
                "0",
                str(WORKER),
            ]
            for node in (0, 1)
        ],
        envs=[env, env],
        cwd=str(ROOT),
        timeout=150,
    )
    text = "\n".join(outputs)
    assert all(a.returncode == 0 for a in agents), text[-4000:]
    lines = re.findall(
        r"FLEXDISPATCH_OK rank=(\d+) nodes=(\d+) ranks_per_node=(\d+) source=(\S+)", text
    )
    assert sorted(int(r) for r, *_ in lines) == [0, 1, 2, 3], text[-4000:]
    assert all((n, l, s) == ("2", "2", "LOCAL_WORLD_SIZE") for _, n, l, s in lines), lines
