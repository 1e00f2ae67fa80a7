"""ddpkit.agent: torchrun, its workers forked from a pre-imported zygote.

Each worker must be what torchrun's Popen would have started (environment,
argv, session, thread count, output files, exit code), so the tests run the
same program under torch's torchrun and under ddpkit.agent side by side and
compare; where they must differ (who the parent is, what was imported before
the program's first line) they say so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ddpkit.agent import handler
from ddpkit.launch.local import free_port
from ddpkit.shared.exitcodes import WORKER_CODES
from tests.helpers.runs import ROOT
from tests.helpers.tiers import full_case

TORCHRUN, AGENT = "torch.distributed.run", "ddpkit.agent"

PROGRAM = """\
import json, os, signal, sys, time
preloaded = {name: name in sys.modules for name in ("torch", "torch._dynamo", "ddpkit.train.main")}
extra = os.environ.get("PROBE_MODULE")
import torch
rank = int(os.environ["RANK"])
# one write of the whole line: the two workers share the agent's stdout, and print's two writes interleave
os.write(1, ("PROBE " + json.dumps({
    "rank": rank, "pid": os.getpid(), "ppid": os.getppid(), "leader": os.getpgid(0) == os.getpid(),
    "argv": sys.argv, "file": __file__, "name": __name__, "cwd": os.getcwd(), "threads": torch.get_num_threads(),
    "omp": os.environ.get("OMP_NUM_THREADS"), "preloaded": preloaded,
    "extra_preloaded": extra is not None and extra in sys.modules,
    "cuda_usable": not torch.cuda._is_in_bad_fork() and not torch.cuda.is_initialized(),
    "signals": {s.name: str(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                                           signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)},
    "cmdline": [a.decode() for a in open("/proc/self/cmdline", "rb").read().split(b"\\0") if a]}) + "\\n").encode())
sys.stdout.write("UNBUFFERED\\n")  # no flush: only -u (or its stand-in) writes it through before os._exit
mode = sys.argv[1]
if mode == "ok":
    os._exit(0)
if rank == 0 and mode == "exit":
    sys.exit(75)
if rank == 0 and mode == "raise":
    raise RuntimeError("boom in the worker")
if rank == 0 and mode == "os-exit":
    os._exit(13)
if rank == 0 and mode == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
if mode != "ok":
    time.sleep(120)  # the other rank: ended by the agent once rank 0 failed
"""


def run(tmp: Path, agent: str, mode: str, *flags: str, env: dict[str, str] | None = None,
        ) -> subprocess.CompletedProcess[str]:
    program = tmp / "program.py"
    program.write_text(PROGRAM)
    argv = [sys.executable, "-m", agent, "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", *flags, str(program), mode]
    full_env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", **(env or {})}
    full_env.pop("OMP_NUM_THREADS", None)  # torchrun sets it to 1 for more than one worker
    return subprocess.run(argv, cwd=tmp, env=full_env, capture_output=True, text=True, timeout=240)


def probes(text: str) -> dict[int, dict]:
    found = [json.loads(line.split("PROBE ", 1)[1]) for line in text.splitlines() if "PROBE " in line]
    return {p["rank"]: p for p in found}


def exit_codes(stderr: str) -> dict[int, int]:
    """rank -> exit code, from torchrun's failure summary."""
    found = re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)", stderr)
    return {int(rank): int(code) for rank, code in found}


@pytest.mark.slow
def test_workers_are_forked_from_the_zygote_and_see_what_torchrun_gives_them(tmp_path: Path) -> None:
    plain, forked = run(tmp_path, TORCHRUN, "ok"), run(tmp_path, AGENT, "ok")
    assert plain.returncode == forked.returncode == 0, forked.stdout + forked.stderr
    before, after = probes(plain.stdout), probes(forked.stdout)
    assert sorted(before) == sorted(after) == [0, 1]
    for rank in (0, 1):
        old, new = before[rank], after[rank]
        # the same world as torchrun's: argv, file, name, cwd, a session of its own
        for key in ("argv", "file", "name", "cwd", "leader"):
            assert new[key] == old[key], (key, old, new)
        # the signal handlers a new interpreter starts with (the zygote ignores these signals itself),
        # but for the stop signals, which the preamble handles (preamble/stop.py)
        preamble_handles = {"SIGTERM", "SIGUSR2"}
        assert {k: v for k, v in new["signals"].items() if k not in preamble_handles} == \
            {k: v for k, v in old["signals"].items() if k not in preamble_handles}
        assert all("_on_signal" in new["signals"][name] for name in preamble_handles), new["signals"]
        assert new["leader"] and new["file"] == str(tmp_path / "program.py")
        # the thread count in force: torchrun's 1 for two workers, the agent's share of the cores
        share = max(1, len(os.sched_getaffinity(0)) // 2)
        assert (old["omp"], old["threads"]) == ("1", 1) and (new["omp"], new["threads"]) == (str(share), share)
        # ps shows the worker's own line, not the agent's
        assert new["cmdline"] == old["cmdline"] == [sys.executable, "-u", str(tmp_path / "program.py"), "ok"]
        # what differs: torch and the trainer were imported before the program's first line
        assert old["preloaded"] == {"torch": False, "torch._dynamo": False, "ddpkit.train.main": False}
        assert new["preloaded"] == {"torch": True, "torch._dynamo": True, "ddpkit.train.main": True}
        # nothing the zygote preloads initialised CUDA: a forked worker can use the GPU as a new interpreter can
        assert new["cuda_usable"] and old["cuda_usable"]
    # both workers are children of one zygote, not of the agent (whose children torchrun's are)
    assert after[0]["ppid"] == after[1]["ppid"] != before[0]["ppid"]
    assert forked.stdout.count("UNBUFFERED") == 2


@pytest.mark.slow
# exit and os-exit end the worker as [raise] does, with another code; a killed worker's restart:
# test_same_error_local.py's control
@pytest.mark.parametrize("mode", [full_case("exit"), "raise", full_case("os-exit"), full_case("killed")])
def test_a_failed_worker_ends_the_agent_as_under_torchrun(tmp_path: Path, mode: str) -> None:
    plain, forked = run(tmp_path, TORCHRUN, mode), run(tmp_path, AGENT, mode)
    expected = {"exit": 75, "raise": 1, "os-exit": 13, "killed": -9}[mode]
    # torchrun ends with 1 whatever its worker's code; ddpkit's agent passes on a code of ddpkit's own
    # (75, 13: exitcodes.WORKER_CODES), which a scheduler records as the job's, else ends as torchrun
    assert plain.returncode == 1 and forked.returncode == (expected if expected in WORKER_CODES else 1), \
        forked.stderr[-3000:]
    # rank 0's code as its root cause; rank 1 ended by the agent's SIGTERM, in both
    assert exit_codes(plain.stderr) == exit_codes(forked.stderr) == {0: expected, 1: -15}, forked.stderr[-3000:]
    if mode == "raise":
        # the program's traceback as an interpreter prints it: from its own frame, nothing of the zygote
        trace = forked.stderr[forked.stderr.index("Traceback"):]
        assert trace.splitlines()[1].startswith(f'  File "{tmp_path / "program.py"}", line ')
        assert "RuntimeError: boom in the worker" in trace
        assert "zygote" not in forked.stderr


@pytest.mark.slow
def test_log_files_get_each_workers_output(tmp_path: Path) -> None:
    """--redirects/--log-dir (launch local's --tee too): the files torchrun opened, written by the fork."""
    done = run(tmp_path, AGENT, "ok", "--redirects=3", f"--log-dir={tmp_path / 'logs'}")
    assert done.returncode == 0, done.stderr[-3000:]
    outs = sorted((tmp_path / "logs").rglob("stdout.log"))
    assert len(outs) == 2
    assert sorted(probes(out.read_text())[rank]["rank"] for rank, out in enumerate(outs)) == [0, 1]


@pytest.mark.slow
def test_fork_off_starts_workers_as_new_interpreters(tmp_path: Path) -> None:
    """A new interpreter each, the program under `ddpkit.run` (the preamble a fork would have had)."""
    done = run(tmp_path, AGENT, "ok", env={"DDPKIT_AGENT_FORK": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    found = probes(done.stdout)
    assert sorted(found) == [0, 1]
    for p in found.values():
        assert not p["preloaded"]["ddpkit.train.main"] and p["cuda_usable"]
        assert p["argv"] == [str(tmp_path / "program.py"), "ok"] and p["name"] == "__main__"
        assert p["cmdline"] == [sys.executable, "-u", "-m", "ddpkit.run", str(tmp_path / "program.py"), "ok"]
    assert "zygote" not in done.stderr


@pytest.mark.slow
def test_a_preload_that_initialises_cuda_makes_workers_start_as_interpreters(tmp_path: Path) -> None:
    """A module that asks the CUDA runtime for devices while imported (here: with NVML's check
    off, as on a host without NVML) leaves every fork of the zygote unable to use CUDA: the agent
    says so once and starts its workers as new interpreters, which can."""
    (tmp_path / "touches_cuda.py").write_text("import torch\ntorch._C._cuda_getDeviceCount()\n")
    done = run(tmp_path, AGENT, "ok", env={"DDPKIT_AGENT_PRELOAD": "touches_cuda", "PROBE_MODULE": "touches_cuda"})
    assert done.returncode == 0, done.stderr[-3000:]
    found = probes(done.stdout)
    assert sorted(found) == [0, 1]
    assert all(p["cuda_usable"] and not p["extra_preloaded"] and not p["preloaded"]["ddpkit.train.main"]
               for p in found.values())
    [line] = [line for line in done.stderr.splitlines() if "new interpreters" in line]
    assert line == ("ddpkit.agent: workers start as new interpreters: the zygote's imports initialised CUDA, "
                    "and a forked worker could not use the GPU (DDPKIT_AGENT_PRELOAD=touches_cuda)")


@pytest.mark.slow
def test_a_module_named_in_agent_preload_is_imported_before_the_program(tmp_path: Path) -> None:
    (tmp_path / "heavy.py").write_text("import torch\nprint('imported once', flush=True)\n")
    done = run(tmp_path, AGENT, "ok", env={"DDPKIT_AGENT_PRELOAD": " heavy, ", "PROBE_MODULE": "heavy"})
    assert done.returncode == 0, done.stderr[-3000:]
    found = probes(done.stdout)
    assert sorted(found) == [0, 1] and all(p["extra_preloaded"] and p["cuda_usable"] for p in found.values())
    assert done.stdout.count("imported once") == 1  # in the zygote, not in each worker
    assert "new interpreters" not in done.stderr


def test_only_this_interpreters_python_u_line_goes_to_the_zygote() -> None:
    env = {"A": "1"}
    ok = handler.request_for((sys.executable, "-u", "-m", "ddpkit.train", "--x"), env, None, None)
    assert ok is not None and ok.argv == ("-m", "ddpkit.train", "--x") and ok.cwd == os.getcwd()
    assert handler.request_for(("/other/python", "-u", "x.py"), env, None, None) is None  # PYTHON_EXEC
    assert handler.request_for(("numactl", "--cpunodebind=0", sys.executable, "-u", "x.py"), env, None, None) is None
    assert handler.request_for((sys.executable, "x.py"), env, None, None) is None


def test_torchs_worker_start_is_where_the_agent_hooks_in() -> None:
    """The hook is torch's module attribute: a torch release that moves it must fail here, not slow down silently."""
    assert handler.unsupported() is None


def test_a_forked_worker_is_waited_for_without_a_timeout_and_its_exit_told(tmp_path: Path) -> None:
    """The Popen half torchrun does not use: wait() with no timeout, terminate; in a fresh
    interpreter (a zygote is forked only while its process has one thread; pytest's has more)."""
    (tmp_path / "exits.py").write_text("import sys, time\nif sys.argv[1] == 'sleep':\n    time.sleep(60)\n"
                                       "sys.exit(int(sys.argv[1]))\n")
    driver = """
import os, sys
from ddpkit.agent import handler, zygote
z = zygote.start(("json",))
assert z is not None
def forked(arg):
    request = handler.request_for((sys.executable, "-u", "exits.py", arg), dict(os.environ), None, None)
    return handler.ForkedProc(z, z.spawn(request), ["exits.py", arg])
print("waited", forked("7").wait())
sleeper = forked("sleep")
assert sleeper.poll() is None
sleeper.terminate()
print("terminated", sleeper.wait(30))
z.close()
print("zygote reaped", z.pid not in [int(p) for p in os.listdir("/proc") if p.isdigit()])
"""
    done = subprocess.run([sys.executable, "-c", driver], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["waited 7", "terminated -15", "zygote reaped True"]


@pytest.mark.slow
def test_workers_end_with_an_agent_that_was_killed(tmp_path: Path) -> None:
    """An agent SIGKILLed (Slurm after KillWait, the OOM killer) takes its zygote and every
    worker with it at once: nothing trains on unsupervised, as torchrun's Popen workers would."""
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    argv = [sys.executable, "-m", AGENT, "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", str(program), "wait"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    agent = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert agent.stdout is not None
        workers: list[dict] = []
        for line in agent.stdout:
            if "PROBE " in line:
                workers.append(json.loads(line.split("PROBE ", 1)[1]))
            if len(workers) == 2:
                break
        procs = [psutil.Process(pid) for pid in (workers[0]["pid"], workers[1]["pid"], workers[0]["ppid"])]
        assert procs[2].ppid() == agent.pid  # the zygote: both workers' parent, the agent's child
        agent.kill()
        agent.wait(10)
        _, alive = psutil.wait_procs(procs, timeout=10)
        assert alive == [], [p.cmdline() for p in alive]
    finally:
        agent.kill()
        agent.wait(10)
