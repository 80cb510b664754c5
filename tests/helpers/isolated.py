"""Run an exported `.pt2` in a Python process that cannot import this project or the user's code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

# Run in `python -I -S`: -I leaves the working directory and PYTHONPATH off sys.path; -S skips the
# site-packages `.pth` files, one of which is the editable install of this project in the shared
# virtualenv. Only the plain directory that holds torch is put back.
SCRIPT = """
import sys
sys.path.append(sys.argv[1])
import torch
for name in ("app", "tests.helpers.user_module"):
    try:
        __import__(name)
    except ImportError:
        continue
    sys.exit(f"{name} is importable in the isolated process")
torch.set_num_threads(int(sys.argv[5]))
program = torch.export.load(sys.argv[2])
inputs = torch.load(sys.argv[3], weights_only=True)
with torch.no_grad():
    torch.save(program.module()(inputs), sys.argv[4])
"""


def predict_in_isolation(program: Path, inputs: torch.Tensor, work: Path) -> torch.Tensor:
    """`torch.export.load(program).module()(inputs)`, computed in a fresh isolated process in `work`
    with this process's intra-op thread count (the tests compare bit for bit with a result computed
    here, and some CPU kernels sum in another order with another thread count)."""
    work.mkdir(parents=True, exist_ok=True)
    torch.save(inputs, work / "inputs.pt")
    torch_site = str(Path(torch.__file__).resolve().parents[1])
    threads = str(torch.get_num_threads())
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", SCRIPT, torch_site, str(program), "inputs.pt", "outputs.pt", threads],
        env={**os.environ, "OMP_NUM_THREADS": threads},  # app/__init__.py gives children 1 thread
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(work / "outputs.pt", weights_only=True)
