"""The thread count (core/threads.py): affinity mask, cgroup v1/v2 quota, physical cores, the option,
OMP_NUM_THREADS, and the wait policy set before torch starts OpenMP."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lmiserve.core import threads


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_option_beats_omp_num_threads_which_beats_detection():
    env = {"OMP_NUM_THREADS": "3"}
    assert threads.choose(2, env, cpus={0, 1, 2, 3}, detect=False).threads == 2
    choice = threads.choose(None, env, cpus={0, 1, 2, 3}, detect=False)
    assert (choice.threads, choice.reason) == (3, "OMP_NUM_THREADS")
    assert threads.choose(0, {"OMP_NUM_THREADS": "4,2"}, detect=False).threads == 4  # nested list: the outer


def test_the_smallest_bound_wins_and_the_reason_names_it():
    choice = threads.choose(None, {}, cpus={0, 1, 2, 3, 4, 5, 6, 7}, quota=2.5, cores=4, detect=False)
    assert choice.threads == 2
    assert choice.reason == "the smallest of: 8 CPUs in the affinity mask, a cgroup quota of 2.5 CPUs, 4 physical cores"
    assert threads.choose(None, {}, cpus={0, 1}, quota=None, cores=None, detect=False).threads == 2
    assert threads.choose(None, {}, cpus={0, 1, 2, 3}, quota=0.5, detect=False).threads == 1  # at least one
    assert threads.choose(None, {}, cpus={0, 1, 2, 3}, cores=2, detect=False).threads == 2


def test_cgroup_v2_quota_is_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    proc = tmp_path / "cgroup"
    write(proc, "0::/kubepods/pod1/ctr\n")
    write(tmp_path / "fs/kubepods/cpu.max", "400000 100000\n")
    write(tmp_path / "fs/kubepods/pod1/cpu.max", "150000 100000\n")
    write(tmp_path / "fs/kubepods/pod1/ctr/cpu.max", "max 100000\n")
    assert threads.cgroup_quota(tmp_path / "fs", proc) == 1.5
    write(tmp_path / "fs/kubepods/pod1/cpu.max", "max 100000\n")
    assert threads.cgroup_quota(tmp_path / "fs", proc) == 4.0
    write(tmp_path / "fs/kubepods/cpu.max", "max 100000\n")
    assert threads.cgroup_quota(tmp_path / "fs", proc) is None


def test_cgroup_v2_inside_a_container_namespace_reads_the_mount_itself(tmp_path):
    write(tmp_path / "cgroup", "0::/\n")
    write(tmp_path / "fs/cpu.max", "100000 100000\n")
    assert threads.cgroup_quota(tmp_path / "fs", tmp_path / "cgroup") == 1.0


def test_cgroup_v1_cfs_quota(tmp_path):
    write(tmp_path / "cgroup", "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "50000\n")
    write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    write(tmp_path / "fs/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    write(tmp_path / "fs/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert threads.cgroup_quota(tmp_path / "fs", tmp_path / "cgroup") == 0.5
    write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    assert threads.cgroup_quota(tmp_path / "fs", tmp_path / "cgroup") is None


def test_no_cgroup_file_means_no_quota(tmp_path):
    assert threads.cgroup_quota(tmp_path, tmp_path / "missing") is None


def test_physical_cores_count_sibling_sets_among_the_allowed_cpus(tmp_path):
    for cpu, siblings in {0: "0,4", 1: "1,5", 4: "0,4", 5: "1,5", 2: "2,6"}.items():
        write(tmp_path / f"cpu{cpu}/topology/core_cpus_list", siblings + "\n")
    assert threads.physical_cores({0, 1, 4, 5}, tmp_path) == 2
    assert threads.physical_cores({0, 1, 2, 4, 5}, tmp_path) == 3
    assert threads.physical_cores({7}, tmp_path) is None  # sysfs does not say
    assert threads.physical_cores(set(), tmp_path) is None


def test_prepare_environment_sets_the_counts_and_a_bounded_spin():
    env: dict[str, str] = {}
    choice = threads.prepare_environment(threads.ThreadChoice(2, "x", "default"), env)
    assert env == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "2", "GOMP_SPINCOUNT": "10000"}
    assert choice.wait_policy == "GOMP_SPINCOUNT=10000"
    assert not choice.given and threads.choose(3, env, detect=False).given
    assert threads.choose(None, env, detect=False).given  # OMP_NUM_THREADS (here the one just set)


def test_a_wait_policy_the_user_set_is_kept():
    env = {"OMP_WAIT_POLICY": "ACTIVE", "NUMBA_NUM_THREADS": "8"}
    choice = threads.choose(None, env, cpus={0, 1}, detect=False)
    assert choice.wait_policy == "OMP_WAIT_POLICY=ACTIVE"
    threads.prepare_environment(choice, env)
    assert "GOMP_SPINCOUNT" not in env and env["OMP_WAIT_POLICY"] == "ACTIVE"
    assert env["NUMBA_NUM_THREADS"] == "8"  # the user's pool size is theirs


CHILD = """
import json, os, sys
from lmiserve.core import threads
choice = threads.prepared(None)
from lmiserve.engine.cpu_threads import apply
apply(choice.threads)
import numba, torch
print(json.dumps({"threads": choice.threads, "reason": choice.reason, "wait": choice.wait_policy,
                  "torch": torch.get_num_threads(), "numba": numba.get_num_threads(),
                  "spin": os.environ.get("GOMP_SPINCOUNT")}))
"""


def run_child(prefix: list[str], env_extra: dict[str, str] | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.pop("NUMBA_NUM_THREADS", None)
    env.update(env_extra or {})
    out = subprocess.run([*prefix, sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    result: dict = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset is not installed")
def test_a_process_pinned_to_one_cpu_runs_one_thread_everywhere():
    result = run_child(["taskset", "-c", str(min(os.sched_getaffinity(0)))])
    assert result["threads"] == result["torch"] == result["numba"] == 1
    assert result["reason"].startswith("the smallest of: 1 CPUs in the affinity mask")
    assert result["wait"] == "GOMP_SPINCOUNT=10000" and result["spin"] == "10000"


def test_omp_num_threads_is_honoured_in_a_fresh_process():
    result = run_child([], {"OMP_NUM_THREADS": "1"})
    assert (result["threads"], result["reason"], result["torch"], result["numba"]) == (1, "OMP_NUM_THREADS", 1, 1)


CPU_V1 = Path("/sys/fs/cgroup/cpu")


@pytest.mark.skipif(
    not (CPU_V1 / "cpu.cfs_quota_us").exists() or not os.access(CPU_V1, os.W_OK) or len(os.sched_getaffinity(0)) < 2,
    reason="needs a writable cgroup v1 cpu controller and 2 CPUs",
)
def test_a_real_cgroup_quota_of_one_cpu_gives_one_thread():
    group = CPU_V1 / f"lmiserve-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
        script = f'echo $$ > {group}/cgroup.procs && exec "$@"'
        result = run_child(["sh", "-c", script, "sh"])
        assert result["threads"] == result["torch"] == 1
        assert "a cgroup quota of 1 CPUs" in result["reason"]
    finally:
        group.rmdir()


def test_the_kernels_run_on_tbb_where_it_is_installed():
    """numba's OpenMP layer launches 2.5x slower from the engine's thread than from the main thread
    (engine/jit.py); with the tbb package installed (a dependency on x86-64) the kernels use TBB."""
    from importlib import metadata

    from lmiserve.engine import jit

    try:
        metadata.version("tbb")
    except metadata.PackageNotFoundError:
        pytest.skip("tbb is not installed here")
    if os.environ.get("NUMBA_THREADING_LAYER"):
        pytest.skip("the user's NUMBA_THREADING_LAYER is kept")
    assert jit.THREADING_LAYER == "tbb"
    import torch

    from lmiserve.engine.model import skinny_gemm

    skinny_gemm.linear(torch.ones(2, 8), torch.ones(4, 8))
    assert jit.numba.threading_layer() == "tbb"
