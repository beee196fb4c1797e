"""The thread team's size from the affinity mask and the cgroup's CPU quota, read from fake /proc and /sys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.engine.cpu_tuning import SPIN_COUNT, CpuBudget, cgroup_cpu_quota, default_wait_policy

V2_MOUNTS = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"
V1_MOUNTS = (
    "tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0\n"
    "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0\n"
    "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"
)


def fake_tree(tmp_path: Path, cgroup: str, mounts: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mounts").write_text(mounts)
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_v2_quota_of_the_process_group(tmp_path):
    root = fake_tree(
        tmp_path,
        "0::/kubepods/pod1/worker\n",
        V2_MOUNTS,
        {
            "sys/fs/cgroup/cpu.max": "max 100000\n",
            "sys/fs/cgroup/kubepods/cpu.max": "max 100000\n",
            "sys/fs/cgroup/kubepods/pod1/worker/cpu.max": "150000 100000\n",
        },
    )
    assert cgroup_cpu_quota(root) == 1.5
    budget = CpuBudget.read(root, affinity=4)
    assert (budget.quota, budget.cores, budget.threads) == (1.5, 1.5, 2)


def test_v2_tightest_ancestor_wins(tmp_path):
    root = fake_tree(
        tmp_path,
        "0::/pod/worker\n",
        V2_MOUNTS,
        {
            "sys/fs/cgroup/pod/cpu.max": "50000 100000\n",
            "sys/fs/cgroup/pod/worker/cpu.max": "300000 100000\n",
        },
    )
    assert cgroup_cpu_quota(root) == 0.5
    assert CpuBudget.read(root, affinity=8).threads == 1  # never fewer than one thread


def test_v2_unlimited(tmp_path):
    root = fake_tree(tmp_path, "0::/\n", V2_MOUNTS, {"sys/fs/cgroup/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root) is None
    assert CpuBudget.read(root, affinity=3).threads == 3


def test_v2_container_view_reads_the_mount_root(tmp_path):
    # in a container the path /proc shows may not exist under the container's own mount
    root = fake_tree(
        tmp_path, "0::/../../system.slice/x\n", V2_MOUNTS, {"sys/fs/cgroup/cpu.max": "250000 100000"}
    )
    assert cgroup_cpu_quota(root) == 2.5
    assert CpuBudget.read(root, affinity=4).threads == 3  # 2.5 rounds half up


def test_v1_cfs_quota(tmp_path):
    base = "sys/fs/cgroup/cpu,cpuacct"
    root = fake_tree(
        tmp_path,
        "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
        V1_MOUNTS,
        {
            f"{base}/cpu.cfs_quota_us": "-1\n",
            f"{base}/cpu.cfs_period_us": "100000\n",
            f"{base}/docker/abc/cpu.cfs_quota_us": "140000\n",
            f"{base}/docker/abc/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpu_quota(root) == pytest.approx(1.4)
    assert CpuBudget.read(root, affinity=2).threads == 1  # 0.4 of a core is left to the other threads


def test_v1_unlimited_and_affinity_caps(tmp_path):
    base = "sys/fs/cgroup/cpu,cpuacct"
    root = fake_tree(
        tmp_path,
        "4:cpu,cpuacct:/\n",
        V1_MOUNTS,
        {f"{base}/cpu.cfs_quota_us": "800000\n", f"{base}/cpu.cfs_period_us": "100000\n"},
    )
    budget = CpuBudget.read(root, affinity=2)
    assert (budget.quota, budget.cores, budget.threads) == (8.0, 2.0, 2)


def test_no_cgroup_files_and_junk(tmp_path):
    assert cgroup_cpu_quota(tmp_path) is None  # no /proc at all
    root = fake_tree(
        tmp_path, "garbage\n0::/a\n", V2_MOUNTS + "short line\n", {"sys/fs/cgroup/a/cpu.max": "x y"}
    )
    assert cgroup_cpu_quota(root) is None
    assert CpuBudget.read(root, affinity=2).threads == 2


def test_real_machine_budget_is_sane():
    budget = CpuBudget.read()
    assert budget.affinity == len(os.sched_getaffinity(0))
    assert 1 <= budget.threads <= budget.affinity


def test_wait_policy_respects_the_operator():
    env = {"OMP_WAIT_POLICY": "active"}
    assert default_wait_policy(env) is False and "GOMP_SPINCOUNT" not in env
    env = {"GOMP_SPINCOUNT": "123"}
    assert default_wait_policy(env) is False and env["GOMP_SPINCOUNT"] == "123"
    env = {}
    default_wait_policy(env)  # torch is already loaded in this process: set, but too late to matter here
    assert env["GOMP_SPINCOUNT"] == str(SPIN_COUNT)


def test_llm_entry_point_sets_the_policy_before_torch_loads():
    code = (
        "import os, sys\n"
        "import specserve\n"
        "specserve.LLM\n"
        "assert 'torch' in sys.modules\n"
        "print(os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    repo = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=repo, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(SPIN_COUNT)
