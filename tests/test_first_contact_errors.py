"""One line, a documented exit code and nothing left behind where a new user
used to get a traceback or a Slurm tool's raw output:
`-f` naming a folder, `--templates` naming no templates, `submit slurm`
without Slurm's client, and with a client that has no cluster configured.
The unconfigured client is a stand-in that prints Slurm's own words (a real
unconfigured Slurm cannot be set up in a unit test)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ddpkit.cli import main
from ddpkit.render.engine import default_template_dir
from ddpkit.shared.exitcodes import ExitCode
from tests.test_startup import ROOT

SPEC = str(ROOT / "examples" / "cpu-smoke.yaml")

# What sbatch / scontrol 23.x print on a host with no slurm.conf and no DNS SRV record.
NOT_CONFIGURED = """{tool}: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host
{tool}: error: fetch_config: DNS SRV lookup failed
{tool}: error: _establish_config_source: failed to fetch config
{tool}: fatal: Could not establish a configuration source
"""
REFUSED = "sbatch: error: Batch job submission failed: Invalid partition name specified\n"


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    return err.rstrip("\n")


def test_a_folder_for_the_job_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "job.yaml").write_text("name: x\n")
    code, out, err = run_cli(["render", "slurm", "-f", str(tmp_path), "-o", str(tmp_path / "out")], capsys)
    assert (code, out) == (ExitCode.BAD_INPUT, "")
    assert one_line(err) == (f"ddpkit: -f {tmp_path}: that is a folder; pass one of its YAML files (job.yaml) "
                             "(nothing was written or started)")
    assert not (tmp_path / "out").exists()


def test_templates_that_are_not_there_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere"
    code, out, err = run_cli(["render", "slurm", "-f", SPEC, "--templates", str(missing)], capsys)
    assert (code, out) == (ExitCode.BAD_INPUT, "")
    line = one_line(err)
    assert line.startswith(f"ddpkit: --templates {missing}: no such folder; pass a folder holding your copy"), line
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = run_cli(["render", "slurm", "-f", SPEC, "--templates", str(empty), "-o", str(tmp_path / "o")],
                             capsys)
    assert (code, out) == (ExitCode.BAD_INPUT, "")
    line = one_line(err)
    assert line.startswith(f"ddpkit: --templates {empty}: has no slurm/job.sbatch.j2; copy it from "), line
    assert line.endswith("templates/slurm/job.sbatch.j2, or leave --templates out"), line
    assert not (tmp_path / "o").exists()


def test_a_stale_copy_of_the_templates_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A copy made for another version names a variable this one does not pass
    (the k8s templates read views, not `spec`): the user's copy, exit 2."""
    copy = tmp_path / "templates"
    shutil.copytree(default_template_dir(), copy)
    (copy / "k8s" / "pytorchjob.yaml.j2").write_text("# job {{ spec.name }}\n")
    code, out, err = run_cli(["render", "k8s", "-f", SPEC, "--templates", str(copy), "-o", str(tmp_path / "o")],
                             capsys)
    assert (code, out) == (ExitCode.BAD_INPUT, "")
    line = one_line(err)
    assert line.startswith(f"ddpkit: --templates {copy}: k8s/pytorchjob.yaml.j2: 'spec' is undefined"), line
    assert line.endswith("templates/k8s/pytorchjob.yaml.j2, or leave --templates out"), line
    assert not (tmp_path / "o").exists()


def fake_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tools: dict[str, tuple[str, int]]) -> Path:
    """PATH = a folder with bash (render's `bash -n`) and these stand-ins
    (name -> (stderr, exit status)); no other Slurm command."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    bash = shutil.which("bash")
    assert bash is not None
    (bin_dir / "bash").symlink_to(bash)
    for name, (stderr, status) in tools.items():
        (bin_dir / f"{name}.err").write_text(stderr)
        (bin_dir / name).write_text(f"#!{bash}\necho called >> {tmp_path}/called\n"
                                    f"while IFS= read -r line; do echo \"$line\" >&2; done < {bin_dir}/{name}.err\n"
                                    f"exit {status}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    folder = tmp_path / "jobs"
    folder.mkdir()
    return folder


@pytest.mark.parametrize(("flags", "tool"), [(["--no-check"], "sbatch"), ([], "scontrol")])
def test_submit_without_slurm_on_path_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch, flags: list[str],
                                                  tool: str) -> None:
    folder = fake_path(tmp_path, monkeypatch, {})
    code, out, err = run_cli(["submit", "slurm", "-f", SPEC, "--dir", str(folder), *flags], capsys)
    assert (code, out) == (ExitCode.PREFLIGHT, "")
    assert one_line(err).startswith(f"ddpkit: {tool} is not on PATH: this host has no Slurm client "
                                    "(nothing was written or submitted); run ddpkit submit slurm on a login node")
    assert list(folder.iterdir()) == []


def test_submit_follow_without_squeue_is_one_line_before_sbatch(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """--follow asks squeue how the job is doing: a host without it is told before anything is submitted."""
    folder = fake_path(tmp_path, monkeypatch, {"sbatch": ("", 0)})
    code, out, err = run_cli(["submit", "slurm", "-f", SPEC, "--dir", str(folder), "--no-check", "--follow"], capsys)
    assert (code, out) == (ExitCode.PREFLIGHT, "")
    assert one_line(err).startswith("ddpkit: squeue is not on PATH: this host has no Slurm client ")
    assert list(folder.iterdir()) == [] and not (tmp_path / "called").exists()  # sbatch never ran


@pytest.mark.parametrize("flags", [[], ["--no-check"]], ids=["checked", "no-check"])
def test_submit_where_slurm_is_not_configured_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch, flags: list[str]) -> None:
    folder = fake_path(tmp_path, monkeypatch, {t: (NOT_CONFIGURED.format(tool=t), 1) for t in ("sbatch", "scontrol")})
    code, out, err = run_cli(["submit", "slurm", "-f", SPEC, "--dir", str(folder), *flags], capsys)
    tool = "sbatch" if flags else "scontrol"
    assert (code, out) == (ExitCode.PREFLIGHT, "")
    assert one_line(err) == (f"ddpkit: Slurm is installed on this host but not configured ({tool}: Could not "
                             "establish a configuration source); nothing was submitted: run on a login node of the "
                             "cluster, or set SLURM_CONF to the cluster's slurm.conf")
    assert list(folder.iterdir()) == []  # the rendered script is gone with the job that was not submitted
    assert (tmp_path / "called").read_text() == "called\n"  # the one tool asked, once


def test_a_job_sbatch_refuses_exits_2_and_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    folder = fake_path(tmp_path, monkeypatch, {"sbatch": (REFUSED, 1)})
    code, out, err = run_cli(["submit", "slurm", "-f", SPEC, "--dir", str(folder), "--no-check"], capsys)
    assert (code, out) == (ExitCode.BAD_INPUT, "")
    assert err == REFUSED + ("ddpkit: sbatch refused the job (nothing was submitted); fix what it names, or submit "
                             "without --no-check to have it checked first\n")
    assert list(folder.iterdir()) == []


def test_a_script_that_was_there_before_is_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    folder = fake_path(tmp_path, monkeypatch, {"sbatch": (REFUSED, 1)})
    (folder / "cpu-smoke.sbatch").write_text("#!/bin/bash\n# the user's own\n")
    code, _, _ = run_cli(["submit", "slurm", "-f", SPEC, "--dir", str(folder), "--no-check"], capsys)
    assert code == ExitCode.BAD_INPUT
    assert [p.name for p in folder.iterdir()] == ["cpu-smoke.sbatch"]


def test_kubernetes_files_are_named_by_job_and_kind_and_stdout_names_no_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two jobs rendered into one folder keep their own files (as Slurm's
    `<job>.sbatch` do); to stdout, the notes name no file."""
    out = tmp_path / "out"
    for name in ("first", "second"):
        code, text, err = run_cli(["render", "k8s", "--set", f"name={name}", "-o", str(out)], capsys)
        assert code == 0, err
        assert text == f"wrote {out / f'{name}.pytorchjob.yaml'}\n"
        assert f"k8s: {name}.pytorchjob.yaml: meets Pod Security level" in err
    assert sorted(p.name for p in out.iterdir()) == ["first.pytorchjob.yaml", "second.pytorchjob.yaml"]
    code, text, err = run_cli(["render", "k8s", "--set", "name=first"], capsys)
    assert code == 0 and text == (out / "first.pytorchjob.yaml").read_text()
    assert err.startswith("k8s: meets Pod Security level") and ".yaml" not in err, err


def test_version_and_a_help_written_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"ddpkit {version('ddpkit')}\n"
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "One PyTorch DDP job, described once" in text and "dispatch" not in text
