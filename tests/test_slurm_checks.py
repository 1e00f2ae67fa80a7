"""The pre-submit cluster check and the pending-reason rules, on the records
`scontrol show partition -o` / `show node -o` print (Slurm 22.05's layout).
The same paths run against a real cluster in tests/test_slurm_real.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpkit.host import scontrol
from ddpkit.launch.slurm import checks as slurm_checks
from ddpkit.launch.slurm.checks import Cluster, gpu_count, megabytes, problems, read_cluster, slurm_seconds
from ddpkit.launch.slurm.jobs import JobState
from ddpkit.spec import JobSpec
from ddpkit.spec.yamlfile import load_spec

PARTITIONS = """\
PartitionName=cpu AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A DefaultTime=NONE \
DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=02:00:00 MinNodes=0 LLN=NO \
MaxCPUsPerNode=UNLIMITED Nodes=c[1-3] PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO \
OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=24 TotalNodes=3 SelectTypeParameters=NONE JobDefaults=(null) \
DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED
PartitionName=gpu AllowGroups=ALL Default=NO MaxNodes=2 MaxTime=1-00:00:00 Nodes=g[1-4] State=UP TotalCPUs=256 \
TotalNodes=4
"""
NODES = """\
NodeName=c1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUEfctv=8 CPUTot=8 CPULoad=0.00 AvailableFeatures=(null) \
ActiveFeatures=(null) Gres=(null) NodeAddr=10.0.0.2 NodeHostName=c1 Version=22.05.8 OS=Linux RealMemory=16000 \
AllocMem=0 FreeMem=N/A Sockets=8 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A \
Partitions=cpu
NodeName=c2 CPUTot=8 Gres=(null) RealMemory=16000 State=IDLE Partitions=cpu
NodeName=c3 CPUTot=8 Gres=(null) RealMemory=16000 State=IDLE Partitions=cpu
NodeName=g1 CPUTot=64 Gres=gpu:a100:4(S:0-1) RealMemory=512000 State=IDLE Partitions=gpu
NodeName=g2 CPUTot=64 Gres=gpu:a100:4(S:0-1) RealMemory=512000 State=IDLE Partitions=gpu
"""


def cluster() -> Cluster:
    return read_cluster(lambda argv: PARTITIONS if "partition" in argv else NODES)


def spec(**overrides: str) -> JobSpec:
    sets = [f"{k.replace('__', '.')}={v}" for k, v in overrides.items()]
    return load_spec(None, overrides=["device=cpu", "backend=gloo", *sets], nodes=None, nproc_per_node=None, image=None)


@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 1800), ("5:30", 330), ("04:00:00", 14400), ("1-00:00:00", 86400), ("2-3", 2 * 86400 + 3 * 3600),
    ("1-02:03", 86400 + 2 * 3600 + 180), ("INFINITE", None), ("UNLIMITED", None),
])
def test_slurm_time_forms(text: str, seconds: int | None) -> None:
    assert slurm_seconds(text) == seconds


def test_memory_and_gres_forms() -> None:
    assert megabytes("64G") == 65536 and megabytes("500M") == 500 and megabytes("1000") == 1000
    assert gpu_count("gpu:8") == 8 and gpu_count("gpu:a100:4(S:0-1)") == 4 and gpu_count("(null)") == 0
    assert gpu_count("gpu:a100:2,gpu:v100:1") == 3


def test_scontrols_three_shapes_are_read_by_the_one_parser() -> None:
    # `-o` records (the launcher's checks and queue, the agent's job output file), `show config`'s lines
    record = scontrol.fields("JobId=7 JobName=j JobState=RUNNING Reason=None StdOut=/home/u/j-7.out Gres=")
    assert record == {"JobId": "7", "JobName": "j", "JobState": "RUNNING", "Reason": "None",
                      "StdOut": "/home/u/j-7.out", "Gres": ""}
    config = "Configuration data as of 2024-01-01T00:00:00\nSlurmdPort              = 6818\nAccountingStorageType   = \n"
    assert scontrol.config_value(config, "SlurmdPort") == "6818"
    assert scontrol.config_value(config, "AccountingStorageType") == ""
    assert scontrol.config_value(config, "SlurmctldPort") is None
    # `show hostnames`: one host a line, in Slurm's order (the launcher's queue and the trainer's launch info)
    assert scontrol.hostnames("gpu07\ngpu08\ncpu1\n") == ["gpu07", "gpu08", "cpu1"]
    assert scontrol.hostnames("") == []


def test_a_job_that_fits_passes() -> None:
    assert problems(spec(nodes="3", slurm__time="01:00:00", slurm__mem="8G"), cluster()) == []


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"nodes": "4"}, "the job asks for 4 nodes but partition 'cpu' has 3; pass --nodes 3"),
    ({"nodes": "3", "slurm__partition": "gpu", "device": "cuda", "nproc_per_node": "4"},
     "has 4 and allows 2 per job; pass --nodes 2"),
    ({"device": "cuda", "nproc_per_node": "2"}, "no node of partition 'cpu' has GPU gres"),
    ({"device": "cuda", "nproc_per_node": "8", "slurm__partition": "gpu"}, "have at most 4; pass --gpus-per-node 4"),
    ({"slurm__time": "03:00:00"}, "slurm.time: 03:00:00 is above partition 'cpu''s limit of 02:00:00"),
    ({"slurm__mode": "srun", "nproc_per_node": "4", "slurm__cpus_per_process": "4"},
     "asks for 16 CPUs per node but the nodes of partition 'cpu' have at most 8"),
    ({"slurm__mem": "64G"}, "slurm.mem: 64G per node is more than any node"),
])
def test_a_job_that_can_never_run_is_refused_with_the_fix(overrides: dict[str, str], expected: str) -> None:
    found = problems(spec(**overrides), cluster())
    assert any(expected in p for p in found), found


def test_an_unknown_partition_is_left_to_sbatch() -> None:
    assert problems(spec(slurm__partition="nosuch", nodes="9"), cluster()) == []


def test_hopeless_reasons_are_only_limits() -> None:
    def pending(reason: str) -> JobState:
        return JobState("PENDING", "", "", "squeue", reason)

    assert pending("PartitionNodeLimit").hopeless and pending("PartitionTimeLimit").hopeless
    assert not pending("Resources").hopeless and not pending("Priority").hopeless
    assert not JobState("RUNNING", "", "node1", "squeue", "PartitionNodeLimit").hopeless
    assert "ReqNodeNotAvail" not in slurm_checks.HOPELESS_REASONS  # nodes can come back


def test_follow_labels_lines_by_task_not_by_the_allocation(tmp_path: Path) -> None:
    """`submit --follow` prints `logs`' lines: the node is the task's place in
    the job (task // tasks_per_node), never a host of Slurm's NodeList, which
    a COMPLETING job shrinks (ci39: rank 1's last line, read then, came out
    under the wrong node) and a requeued run changes."""
    from ddpkit.launch.control.logs import LogRequest, slurm_source
    from ddpkit.runs import RunFolder, RunTarget, SlurmJob

    out = tmp_path / "j-7.out"
    out.write_text("batch shell: 3\n1: PROBE-FAIL rank=1\n3: on the second node\n")
    run = RunFolder.create(name="j", target=RunTarget.SLURM, nodes=2, nproc_per_node=2, spec_yaml="",
                           stop_grace_s=90, root=tmp_path / "runs")
    for srun_mode, want in ((True, ["[node0 rank1] PROBE-FAIL rank=1", "[node1 rank3] on the second node"]),
                            (False, ["[node0] PROBE-FAIL rank=1", "[node1] on the second node"])):
        run.set_slurm(SlurmJob(job_id=7, script=str(tmp_path / "j.sbatch"), output=str(out), tasks_per_node=2,
                               rank_per_task=srun_mode, signal="USR2", signal_grace_s=90))
        source, _ = slurm_source(run.record(), LogRequest())
        assert source.read() == ["[batch] batch shell: 3", *want]


def test_follow_says_each_state_change_a_requeue_and_the_end_after_the_last_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """JobWatch, fed what the one Slurm reader lists poll after poll: one stderr line per
    change of state, pending reason or restart count; the closing line only once the
    backend has printed the job's last lines (close), and the job's exit status."""
    from ddpkit.launch.slurm.follow import JobWatch

    watch = JobWatch(7)
    polls = [JobState("PENDING", "", "", "squeue", "Priority"), JobState("PENDING", "", "", "squeue", "Priority"),
             JobState("RUNNING", "", "node[1-2]", "squeue"),
             JobState("PENDING", "", "", "squeue", "BeginTime", restarts=1),
             JobState("RUNNING", "", "node[2-3]", "squeue", restarts=1)]
    assert all(watch.seen(found) for found in polls)
    assert watch.seen(None)  # between squeue and sacct: the last state holds
    assert not watch.seen(JobState("FAILED", "3:0", "node[2-3]", "scontrol", "NonZeroExitCode", restarts=1))
    said = capsys.readouterr().err.splitlines()
    assert said == ["ddpkit: job 7 PENDING (Priority)", "ddpkit: job 7 RUNNING",
                    "ddpkit: job 7 was requeued (restart 1)", "ddpkit: job 7 PENDING (BeginTime)",
                    "ddpkit: job 7 RUNNING", "ddpkit: job 7 FAILED"]
    assert watch.close() == 3
    assert capsys.readouterr().err == "ddpkit: job 7 ended FAILED (exit code 3:0)\n"
    unknown = JobWatch(8)
    assert not unknown.seen(None) and unknown.close() == 1
    assert "job 8 is unknown to squeue, sacct and scontrol" in capsys.readouterr().err
