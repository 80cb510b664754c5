"""`compile: true`: the networks run compiled, the weights agree with an eager run up to float rounding.

The tolerance: after one epoch of the digits job (40 Adam steps at lr 0.002), every weight within
1e-6 of the eager run's, absolute. Compiled kernels sum in another order (fused reductions), so the
two runs drift apart by rounding, step after step; bit-equality is not on offer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.models.compiling import compile_networks
from app.models.lightning import MLPClassifier
from tests.helpers.in_process import digits_cli
from tests.helpers.user_module import TwoLayerRegressor

TOLERANCE = 1e-6  # well above one epoch of rounding drift, well below a real difference (weights up to 0.2)


def fit_digits(tmp_path: Path, compiled: bool) -> dict[str, torch.Tensor]:
    cli = digits_cli(tmp_path, 1)
    if compiled:
        assert compile_networks(cli.model) == ["net"]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return {name: value.detach().clone() for name, value in cli.model.state_dict().items()}


def test_a_compiled_run_matches_the_eager_run_within_the_stated_tolerance(tmp_path: Path) -> None:
    eager = fit_digits(tmp_path / "eager", compiled=False)
    compiled = fit_digits(tmp_path / "compiled", compiled=True)
    assert compiled.keys() == eager.keys()  # checkpoints stay interchangeable
    worst = max((compiled[name] - eager[name]).abs().max().item() for name in eager if eager[name].is_floating_point())
    assert worst <= TOLERANCE, worst
    # ... and really compiled: an eager run would agree bit for bit.
    assert any(not torch.equal(compiled[name], eager[name]) for name in eager), "nothing ran compiled"
    MLPClassifier().load_state_dict(compiled)


@pytest.mark.quick
def test_only_children_with_parameters_are_compiled_metrics_and_losses_stay_eager() -> None:
    model = MLPClassifier()
    assert compile_networks(model) == ["net"]
    user = TwoLayerRegressor()  # a user's module: layers as direct attributes
    assert compile_networks(user) == ["hidden", "output"]
    assert set(user.state_dict()) == set(TwoLayerRegressor().state_dict())
