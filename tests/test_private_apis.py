"""Every Lightning, PyTorch, torchvision, torchmetrics or CPython private API we rely on
(docs/private_apis.md), one test each.

Each test fails with a message that names what changed and what depends on it, so that a Lightning
upgrade breaks here, loudly, and not as a silent change of behaviour in a long run. pyproject pins
`lightning>=2.6,<2.7`; lift the pin when this file passes on the next minor version.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchmetrics import MeanMetric, Metric
from torchvision import datasets

from app.checkpoints.io import CLI_CLASS_PATH_KEY, CLI_INSTANTIATOR_KEY, summarize_checkpoint
from app.checkpoints.sharded import DCP_INDEX, SafeFileSystemReader, SafeLoadPlanner
from app.cli import DDPAppCLI, NoProfiler, SafeCheckpointIO
from app.cluster import hangs
from app.cluster.ddp_stream import LIGHTNING_DDP_WRAP
from app.cluster.preemption import (
    LIGHTNING_PER_STEP_SIGTERM_BROADCAST,
    LIGHTNING_SIGNAL_HANDLER_INSTALL,
    keep_lightning_off_stop_signals,
)
from app.data.image_datasets import WORKER_PREFIX, UnreadableImageError
from app.errors import one_line_message
from app.export import config_from_hyperparameters
from app.private_apis import PrivateApiChanged, require
from app.resume.exact import DataPosition, ExactResume, canonical_fit_loop_state
from app.resume.metric_state import UPDATE_COUNT, load_per_rank_module_state, per_rank_module_state
from app.resume.position import saved_position
from app.run import console
from app.run.build import TRAINING_FETCH

DOC = "see docs/private_apis.md"


def test_training_epoch_loop_broadcasts_sigterm_through_the_method_last_checkpoint_replaces() -> None:
    method = getattr(_TrainingEpochLoop, LIGHTNING_PER_STEP_SIGTERM_BROADCAST, None)
    assert callable(method), (
        f"Lightning removed _TrainingEpochLoop.{LIGHTNING_PER_STEP_SIGTERM_BROADCAST}: RunCoordinator.on_train_start "
        f"no longer switches off the per-step SIGTERM broadcast; find its replacement ({DOC})"
    )
    assert f"self.{LIGHTNING_PER_STEP_SIGTERM_BROADCAST}()" in inspect.getsource(_TrainingEpochLoop.advance), (
        f"_TrainingEpochLoop.advance no longer calls {LIGHTNING_PER_STEP_SIGTERM_BROADCAST}: replacing it "
        f"does not remove the per-step collective any more ({DOC})"
    )


def test_trainer_installs_its_signal_handlers_through_the_method_ddp_app_replaces() -> None:
    call = f"self._signal_connector.{LIGHTNING_SIGNAL_HANDLER_INSTALL}()"
    assert call in inspect.getsource(Trainer._run), (
        f"Trainer._run no longer calls {call}: keep_lightning_off_stop_signals may no longer keep Lightning's "
        f"SIGTERM handler (a broadcast inside the handler, which hangs a rank) away from a fit ({DOC})"
    )
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    keep_lightning_off_stop_signals(trainer)
    before = signal.getsignal(signal.SIGTERM)
    trainer._signal_connector.register_signal_handlers()  # what Trainer._run calls
    assert signal.getsignal(signal.SIGTERM) is before, f"Lightning installed its SIGTERM handler anyway ({DOC})"


def test_lightning_cli_still_parses_the_checkpoint_path_in_the_method_we_override() -> None:
    assert callable(getattr(LightningCLI, "_parse_ckpt_path", None)), (
        f"LightningCLI._parse_ckpt_path is gone: DDPAppCLI's one-line error for an unreadable ckpt_path "
        f"no longer runs ({DOC})"
    )
    assert "self._parse_ckpt_path()" in inspect.getsource(LightningCLI), (
        f"LightningCLI no longer calls _parse_ckpt_path: DDPAppCLI's override is dead code ({DOC})"
    )


def test_the_last_batch_flag_streams_need(tmp_path: Path) -> None:
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path, enable_progress_bar=False)
    try:
        is_last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    except AttributeError as error:
        pytest.fail(
            f"a loop attribute moved ({error}): ExactResume learns a stream's epoch length from "
            f"fit_loop.epoch_loop.batch_progress.is_last_batch ({DOC})"
        )
    assert is_last_batch is False, f"batch_progress.is_last_batch is {is_last_batch!r} before training ({DOC})"


class _Counted(LightningModule):
    """6 training batches and 2 validation batches per epoch; records what each epoch ran."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.trained: dict[int, int] = {}
        self.validated: dict[int, int] = {}

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.trained[self.current_epoch] = self.trained.get(self.current_epoch, 0) + 1
        self.log("loss", self.layer(batch[0]).pow(2).mean())
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        if not self.trainer.sanity_checking:
            self.validated[self.current_epoch] = self.validated.get(self.current_epoch, 0) + 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(24, 2)), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)


class _SaveThroughLightning(Callback):
    """Saves with Lightning's own hooks at the moments whose fit_loop forms canonical_fit_loop_state writes."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == 1 and batch_idx == 2:
            trainer.save_checkpoint(self.directory / "mid-epoch.ckpt")
        if trainer.current_epoch == 0 and batch_idx == trainer.num_training_batches - 1:
            trainer.save_checkpoint(self.directory / "last-batch.ckpt")

    def on_train_epoch_end(self, trainer: Trainer, module: Any) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.directory / "epoch-end.ckpt")


def _fit(tmp_path: Path, module: LightningModule, callbacks: list[Callback], ckpt_path: Path | None = None) -> None:
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path, callbacks=callbacks,
        plugins=[SafeCheckpointIO()],
    )  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt_path)


def _counters_of(fit_loop: dict[str, Any]) -> dict[str, Any]:
    return {
        "epoch_progress": fit_loop["epoch_progress"],
        "epoch_loop.batch_progress": fit_loop["epoch_loop.batch_progress"],
        "_batches_that_stepped": fit_loop["epoch_loop.state_dict"]["_batches_that_stepped"],
    }


def test_the_fit_loop_forms_canonical_fit_loop_state_writes_are_lightnings_own(tmp_path: Path) -> None:
    """app/resume/exact.py rewrites the loaded fit_loop counters into forms Lightning writes itself: after a
    change of layout or meaning in Lightning, the forms and these saves differ here, in seconds."""
    _fit(tmp_path, _Counted(), [ExactResume(per_sample_seeding=False), _SaveThroughLightning(tmp_path)])
    for name in ("epoch-end", "mid-epoch"):
        checkpoint = torch.load(tmp_path / f"{name}.ckpt", weights_only=True)
        saved = checkpoint["loops"]["fit_loop"]
        try:
            position = DataPosition.from_checkpoint(saved_position(checkpoint))
            rewritten = canonical_fit_loop_state(saved, position, validates=True)
            assert _counters_of(rewritten) == _counters_of(saved), name
        except (KeyError, AssertionError) as error:
            pytest.fail(
                f"Lightning's fit_loop state saved at the {name} no longer has the form "
                f"app/resume/exact.py canonical_fit_loop_state writes ({error!r}); resumes would continue "
                f"at the wrong place ({DOC})"
            )


def test_a_resume_from_the_last_batch_runs_that_epochs_validation_then_the_next_epoch(tmp_path: Path) -> None:
    """The third form (all batches trained, validation pending) is ours: Lightning must resume it as
    "restarted mid-evaluation", run the epoch's validation once and then the whole next epoch."""
    _fit(tmp_path, _Counted(), [ExactResume(per_sample_seeding=False), _SaveThroughLightning(tmp_path)])
    resumed = _Counted()
    _fit(tmp_path / "resumed", resumed, [ExactResume(per_sample_seeding=False)], tmp_path / "last-batch.ckpt")
    assert (resumed.trained, resumed.validated) == ({1: 6}, {0: 2, 1: 2}), (
        f"resumed from a save on epoch 0's last batch, Lightning trained {resumed.trained} and validated "
        f"{resumed.validated} batches per epoch; app/resume/exact.py canonical_fit_loop_state's pending-validation "
        f"form no longer resumes as it should ({DOC})"
    )
    assert resumed.trainer.global_step == 12


def test_a_checkpoint_without_callback_states_still_reaches_exact_resume(tmp_path: Path) -> None:
    """Lightning skips every callback's on_load_checkpoint when "callbacks" is missing; SafeCheckpointIO adds it."""
    _fit(tmp_path, _Counted(), [ExactResume(per_sample_seeding=False), _SaveThroughLightning(tmp_path)])
    checkpoint = torch.load(tmp_path / "epoch-end.ckpt", weights_only=True)
    del checkpoint["callbacks"]
    torch.save(checkpoint, tmp_path / "converted.ckpt")
    resumed = _Counted()
    _fit(tmp_path / "resumed", resumed, [ExactResume(per_sample_seeding=False)], tmp_path / "converted.ckpt")
    assert resumed.trained == {1: 6}, f"resumed from a checkpoint without callback states: trained {resumed.trained}"


def test_lightning_still_profiles_the_training_loaders_next_under_the_name_no_profiler_times(tmp_path: Path) -> None:
    profiler = NoProfiler()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, profiler=profiler, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(_Counted())
    assert profiler.training_fetch_s > 0, (
        f"Lightning no longer calls trainer.profiler.start({TRAINING_FETCH!r}) around the training loader's next(): "
        f"the data part of every step's time (app/run/step_timing.py) reads 0 ({DOC})"
    )


def test_atexit_can_still_run_the_exit_handlers_of_a_forked_rank() -> None:
    # app/cluster/launch.py calls atexit._run_exitfuncs() before a forked rank's os._exit, so that
    # the rank's loggers and user code flush (tests/cluster/test_launch.py checks the effect).
    assert callable(getattr(atexit, "_run_exitfuncs", None)), (
        "CPython's atexit._run_exitfuncs is gone: forked ranks (app/cluster/launch.py) would exit without "
        "running their exit handlers; find another way to run them before os._exit"
    )


def test_threading_can_still_join_the_threads_a_forked_test_command_leaves(tmp_path: Path) -> None:
    # tests/helpers/zygote.py ends a forked ddp-app command as the interpreter does: threading._shutdown()
    # joins its non-daemon threads before the exit handlers run.
    ended = tmp_path / "ended"
    script = (
        "import threading, time, pathlib, os\n"
        f"threading.Thread(target=lambda: (time.sleep(0.2), pathlib.Path({str(ended)!r}).touch())).start()\n"
        "threading._shutdown()\n"
        f"os._exit(0 if pathlib.Path({str(ended)!r}).exists() else 3)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert result.returncode == 0, (
        "CPython's threading._shutdown no longer joins non-daemon threads: a ddp-app command forked from the "
        f"tests' zygote (tests/helpers/zygote.py) would end before its threads do ({DOC})"
    )


def test_ddp_strategy_keeps_ddp_arguments_in_ddp_kwargs() -> None:
    # Read by tests/test_accumulation.py only (the strategy has no public getter for them).
    assert DDPStrategy(static_graph=True)._ddp_kwargs == {"static_graph": True}, (
        f"DDPStrategy._ddp_kwargs changed: tests/test_accumulation.py cannot see static_graph ({DOC})"
    )


def test_lightning_still_wraps_ddp_under_a_side_stream_which_ddp_stream_replaces() -> None:
    source = inspect.getsource(getattr(DDPStrategy, LIGHTNING_DDP_WRAP))
    assert "torch.cuda.Stream()" in source, (
        f"DDPStrategy.{LIGHTNING_DDP_WRAP} no longer builds DistributedDataParallel under a side stream "
        f"(Lightning PR #21746): app/cluster/ddp_stream.py can go ({DOC})"
    )
    assert f"self.{LIGHTNING_DDP_WRAP}(" in inspect.getsource(DDPStrategy.configure_ddp), (
        f"DDPStrategy.configure_ddp no longer wraps the model through {LIGHTNING_DDP_WRAP}: "
        f"app/cluster/ddp_stream.py replaces a method nothing calls ({DOC})"
    )


def test_a_fit_wraps_the_model_in_ddp_with_the_strategys_arguments_through_the_replacement(tmp_path: Path) -> None:
    strategy = "--trainer.strategy=lightning.pytorch.strategies.DDPStrategy"
    cli = DDPAppCLI(
        args=[
            "--config", str(Path(__file__).parents[1] / "configs" / "digits.yaml"), "--trainer.devices=1",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=3", "--trainer.limit_val_batches=0",
            strategy, "--trainer.strategy.bucket_cap_mb=1", "--trainer.strategy.static_graph=true",
        ],
        run=False,
    )  # fmt: skip
    replaced = getattr(cli.trainer.strategy, LIGHTNING_DDP_WRAP)
    assert replaced.__name__ == "wrap_on_the_current_stream", f"the strategy wraps through {replaced} ({DOC})"
    seen: list[Any] = []

    class SeeTheWrapper(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            seen.append(trainer.strategy.model)  # teardown unwraps it again

    cli.trainer.callbacks.append(SeeTheWrapper())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    [wrapped] = seen
    assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
    assert (wrapped.bucket_bytes_cap, wrapped.static_graph) == (2**20, True), "DDP lost the strategy's arguments"
    assert not wrapped.will_sync_module_buffers()  # one rank: nothing to broadcast to (app/cluster/ddp_buffers.py)
    assert cli.trainer.global_step == 3


def test_lightning_sets_current_fx_name_around_every_hook_as_quick_hook_bookkeeping_expects() -> None:
    from lightning.pytorch.trainer import call

    from app.models.lightning import MLPClassifier

    for hook_caller in (call._call_callback_hooks, call._call_lightning_module_hook):
        assert "pl_module._current_fx_name = hook_name" in inspect.getsource(hook_caller), (
            f"Lightning's {hook_caller.__name__} no longer sets _current_fx_name: QuickHookBookkeeping "
            f"(app/models/lightning.py) saves nothing any more ({DOC})"
        )
    module = MLPClassifier()
    assert "_current_fx_name" in vars(module), f"_current_fx_name is no longer a plain attribute ({DOC})"
    module._current_fx_name = "training_step"
    assert module._current_fx_name == "training_step" and vars(module)["_current_fx_name"] == "training_step"


def test_torch_foreach_norm_is_no_longer_used_but_get_total_norm_is_public() -> None:
    grads = [torch.ones(3), torch.tensor([float("nan")])]
    assert not torch.isfinite(torch.nn.utils.get_total_norm(grads, foreach=True)), DOC


def test_torchvision_cifar10_checks_integrity_and_loads_meta_through_the_methods_we_override() -> None:
    source = inspect.getsource(datasets.CIFAR10.__init__)
    for name in ("_check_integrity", "_load_meta"):
        assert callable(getattr(datasets.CIFAR10, name, None)) and f"self.{name}()" in source, (
            f"torchvision's CIFAR10.__init__ no longer calls {name}: app.data.datasets._CIFAR10's "
            f"verify_checksums=False no longer works ({DOC})"
        )


def test_lightning_validates_trainer_arguments_in_the_modules_errors_py_recognises() -> None:
    with pytest.raises(ValueError) as raised:
        Trainer(accelerator="quantum", logger=False)
    assert one_line_message(raised.value) is not None, (
        f"Lightning no longer rejects a bad accelerator name from the module app.errors.LIGHTNING_INPUT_CHECKS "
        f"names, so `--trainer.accelerator=quantum` now prints a traceback ({DOC}): {raised.value!r}"
    )


# Run in a fresh process: the flight recorder reads TORCH_FR_BUFFER_SIZE once, when the first process
# group of the process is made (an earlier test's group would have left it at 0 entries).
DEBUG_ENDPOINT_PROBE = """
import datetime, json, os, sys, tempfile
import torch, torch.distributed as dist
from app.cluster import hangs
server, port = hangs.start_debug_endpoint("127.0.0.1")
assert server is not None and port > 0, "no endpoint"
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
dist.all_reduce(torch.ones(3))
me = hangs.RankAddress(0, "here", os.getpid(), "127.0.0.1", port)
answer = hangs.ask_rank(me, 10)
recorder = answer.collectives
for _ in range(20):
    dist.all_reduce(torch.ones(2))
dist.barrier()
recent = hangs.cut_to_recent(json.loads(hangs.ask(me, hangs.COLLECTIVES_HANDLER, 10)[0]))
later = {
    "entered_now": hangs.entered_now(),
    "recent_seqs": sorted(entry["collective_seq_id"] for entry in recent["entries"]),
    "recent_newest": [str(collective) for collective in hangs.newest_collectives(recent)],
}
print(json.dumps({
    "problem": answer.problem,
    "stacks": answer.stacks,
    "ping": hangs.ask(me, "ping", 10)[0],
    "waited": hangs.ask(me, hangs.WAITED_HANDLER, 10)[0],
    "last_entered": hangs.last_entered(recorder, "0"),
    "last": str(hangs.waited_collective(recorder)),
    "sizes": hangs.waited_collective(recorder).sizes,
    **later,
}))
dist.destroy_process_group()
server.shutdown()
"""


def test_torch_debug_endpoint_answers_stacks_and_flight_recorder_as_the_hang_report_reads_them() -> None:
    result = subprocess.run(
        [sys.executable, "-c", DEBUG_ENDPOINT_PROBE], capture_output=True, text=True, timeout=120,
        env={**os.environ, "TORCH_FR_BUFFER_SIZE": "100"}, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    what = (
        "torch._C._distributed_c10d._WorkerServer, _register_handler, _dump_fr_trace_json, its dump_traceback / "
        "fr_trace_json / ping "
        "handlers or the flight recorder's JSON (pg_status, entries) changed: app.cluster.hangs no longer names "
        f"the rank a hang waits for ({DOC})"
    )
    assert result.returncode == 0, f"{what}\n{result.stderr[-3000:]}"
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["problem"] == "" and 'File "<string>"' in found["stacks"], (what, found)
    assert found["ping"] == "pong" and json.loads(found["waited"]) == {"frames": []}, (what, found)
    assert (found["last_entered"], found["last"], found["sizes"]) == (1, "all_reduce #1", "float[3]"), (what, found)
    # The deadlock check's reads: the status alone (`_dump_fr_trace_json(False, ...)`), and the newest
    # RECENT_ENTRIES collectives another rank asks for.
    assert found["entered_now"] == {"0": 22}, (what, found)
    assert found["recent_seqs"] == list(range(23 - hangs.RECENT_ENTRIES, 23)), (what, found)
    assert found["recent_newest"] == ["barrier #22"], (what, found)


def test_wandb_still_takes_the_experimental_settings_the_sink_passes() -> None:
    wandb = pytest.importorskip("wandb")
    settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_save_requirements=False)
    assert settings.x_disable_stats is True and settings.x_save_requirements is False, (
        "wandb renamed x_disable_stats or x_save_requirements: update app/tracking/sinks.py WandbSink.open_run"
    )


def test_the_strategy_keeps_a_process_group_that_exists_when_fit_sets_up_its_environment(tmp_path: Path) -> None:
    # app/checkpoints/last.py agreed_last_checkpoint starts the process group before `fit` (to broadcast
    # rank 0's last.ckpt); `fit` then calls setup_environment again, which must keep that group.
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy="ddp", logger=False, default_root_dir=tmp_path, enable_progress_bar=False
    )
    trainer.strategy.setup_environment()
    group = torch.distributed.group.WORLD
    trainer.strategy.setup_environment()  # what Trainer._run does
    assert torch.distributed.group.WORLD is group, (
        f"Lightning's setup_environment replaced an existing process group: --ckpt_path last's broadcast "
        f"before fit (app/checkpoints/last.py agreed_last_checkpoint) needs another place ({DOC})"
    )


# ----- torchmetrics (app/resume/metric_state.py) -----


class _MeanOfBatchMeans(Metric):
    """A state reduced by "mean": forward() weighs the batches before it by the update count."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("mean_of_means", torch.tensor(0.0), dist_reduce_fx="mean")
        self.add_state("seen", [], dist_reduce_fx="cat")

    def update(self, values: torch.Tensor) -> None:
        self.mean_of_means = values.mean()
        self.seen.append(values)

    def compute(self) -> torch.Tensor:
        return self.mean_of_means


class _WithMetrics(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.batch_means = _MeanOfBatchMeans()
        self.loss_mean = MeanMetric()


def test_torchmetrics_counts_updates_in_the_attribute_a_mid_epoch_resume_restores() -> None:
    batches = [torch.tensor([1.0, 3.0]), torch.tensor([5.0]), torch.tensor([0.0, 2.0, 4.0])]
    uninterrupted, interrupted, resumed = _WithMetrics(), _WithMetrics(), _WithMetrics()
    for index, batch in enumerate(batches):
        for module in (uninterrupted, interrupted) if index < 2 else (uninterrupted,):
            module.batch_means(batch)
            module.loss_mean(batch)
    counts = (interrupted.batch_means.update_count, getattr(interrupted.batch_means, UPDATE_COUNT, None))
    assert counts == (2, 2), (
        f"a torchmetrics Metric updated twice has (update_count, {UPDATE_COUNT}) == {counts}: "
        f"app/resume/metric_state.py restores the count through {UPDATE_COUNT} on a mid-epoch resume ({DOC})"
    )
    saved = per_rank_module_state(interrupted)
    load_per_rank_module_state(resumed, saved)  # PrivateApiChanged here if torchmetrics renamed it
    assert resumed.batch_means.update_count == 2, (
        f"setting torchmetrics' Metric.{UPDATE_COUNT} no longer sets update_count: a mid-epoch resume "
        f"(app/resume/metric_state.py) restarts every metric's count at 0 ({DOC})"
    )
    assert torch.equal(resumed.loss_mean.mean_value, interrupted.loss_mean.mean_value) and [
        s.tolist() for s in resumed.batch_means.seen
    ] == [s.tolist() for s in interrupted.batch_means.seen], (
        "torchmetrics' Metric.load_state_dict no longer loads non-persistent states: app/resume/metric_state.py "
        f"restores none of an epoch's metric states on a mid-epoch resume ({DOC})"
    )
    resumed.batch_means(batches[2])
    resumed.loss_mean(batches[2])
    for name in ("batch_means", "loss_mean"):
        mine, theirs = getattr(resumed, name).compute(), getattr(uninterrupted, name).compute()
        assert torch.allclose(mine, theirs), (
            f"{name}: resumed after two batches, the metric computes {mine}, uninterrupted {theirs}; "
            f"torchmetrics no longer weighs by {UPDATE_COUNT} as app/resume/metric_state.py restores it ({DOC})"
        )


# ----- LightningCLI's hyperparameters (app/checkpoints/io.py, app/checkpoints/sharded.py, app/export.py) -----


def test_lightning_cli_saves_the_model_class_in_the_hyperparameter_keys_checkpoint_readers_use(tmp_path: Path) -> None:
    cli = DDPAppCLI(
        args=[
            "--config", str(Path(__file__).parents[1] / "configs" / "digits.yaml"), "--trainer.devices=1",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.strategy=auto",
        ],
        run=False,
    )  # fmt: skip
    cli.trainer.strategy.connect(cli.model)
    cli.trainer.save_checkpoint(tmp_path / "saved.ckpt")  # the same dump_checkpoint a fit's saves use
    hyper_parameters = torch.load(tmp_path / "saved.ckpt", weights_only=True)["hyper_parameters"]
    class_path = hyper_parameters.get(CLI_CLASS_PATH_KEY)
    module_name, _, class_name = str(class_path).rpartition(".")
    names_the_class = bool(module_name) and getattr(importlib.import_module(module_name), class_name, None)
    assert names_the_class is type(cli.model) and CLI_INSTANTIATOR_KEY in hyper_parameters, (
        f"LightningCLI no longer saves the model class as hyper_parameters[{CLI_CLASS_PATH_KEY!r}] (and "
        f"{CLI_INSTANTIATOR_KEY!r}): {sorted(hyper_parameters)}; summarize_checkpoint (app/checkpoints/io.py, "
        f"sharded.py) no longer names the checkpoint's model class and python -m app.export no longer "
        f"writes its config ({DOC})"
    )
    summary = summarize_checkpoint(tmp_path / "saved.ckpt")
    assert summary.class_path == class_path and not any(key.startswith("_") for key in summary.hyper_parameters)
    config = config_from_hyperparameters(hyper_parameters)
    assert config is not None and config["class_path"] == class_path
    assert config["init_args"] == summary.hyper_parameters


# ----- DataLoader workers (app/data/image_datasets.py) -----


class _RaisedInWorker(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.raw = message  # what DataLoader builds the re-raised exception from


class _Raising(Dataset):
    def __init__(self, error: Exception) -> None:
        self.error = error

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> Any:
        raise self.error


def _raised_through_a_worker(error: Exception) -> BaseException:
    """What `error`, raised in a real DataLoader worker, becomes in this process (the worker stopped)."""
    iterator = iter(DataLoader(_Raising(error), num_workers=1))
    try:
        next(iterator)
    except Exception as raised:
        # Its frames hold the iterator: cleared, the iterator goes now and stops its worker (left
        # alive, it would be copied into the next test's forked workers, which cannot stop it).
        traceback.clear_frames(raised.__traceback__)
        return raised
    finally:
        del iterator
    pytest.fail(f"a DataLoader worker raised {error!r} and the main process got a batch")


def test_a_dataloader_worker_error_reaches_the_main_process_in_the_form_image_files_reads() -> None:
    raised = _raised_through_a_worker(_RaisedInWorker("boom"))
    assert isinstance(raised, _RaisedInWorker), f"DataLoader re-raised a worker's error as {raised!r} ({DOC})"
    lines = raised.raw.rstrip().splitlines()
    first = f"{WORKER_PREFIX}_RaisedInWorker in DataLoader worker process 0"
    ours = f"{_RaisedInWorker.__module__}.{_RaisedInWorker.__qualname__}: boom"
    assert lines[0].startswith(first) and lines[-1] == ours, (
        f"DataLoader now re-raises a worker's error as {lines[0]!r} ... {lines[-1]!r}: UnreadableImageError "
        f"(app/data/image_datasets.py) reads its '{WORKER_PREFIX}' prefix and the last line, so a bad image in a "
        f"loader worker prints the worker's traceback, not one line ({DOC})"
    )
    message = "data/cat/1.png is not an image (it starts with b'oops')"
    raised = _raised_through_a_worker(UnreadableImageError(message))
    assert isinstance(raised, UnreadableImageError) and str(raised) == message, (
        f"a worker's UnreadableImageError arrives as {raised!r}, not its one line ({DOC})"
    )


# ----- CPython and autograd frames (app/cluster/hangs.py) -----


def _stack_of_a_thread_blocked_in(run: Any, entered: threading.Event, release: threading.Event) -> list[Any]:
    """The stack `sys._current_frames()` shows for a thread that runs `run` and blocks where it sets `entered`."""
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert entered.wait(10), "the thread never reached the point where it blocks"
        frame = sys._current_frames()[thread.ident or 0]
        return [hangs.Frame(f.filename, f.lineno or 0, f.name) for f in traceback.extract_stack(frame)]
    finally:
        release.set()
        thread.join(10)


def test_current_frames_shows_where_another_thread_waits() -> None:
    entered, release = threading.Event(), threading.Event()

    def wait_for_the_collective() -> None:
        entered.set()
        release.wait(10)

    assert callable(getattr(sys, "_current_frames", None)), (
        f"CPython {platform.python_version()} has no sys._current_frames: HangReport (app/cluster/hangs.py) "
        f"cannot read the main thread's stack when the ranks' collectives mismatch ({DOC})"
    )
    names = [frame.name for frame in _stack_of_a_thread_blocked_in(wait_for_the_collective, entered, release)]
    assert "wait_for_the_collective" in names and names[-1] == "wait", (
        f"sys._current_frames() no longer gives a blocked thread's innermost frame ({names}): HangReport "
        f"(app/cluster/hangs.py) would name the wrong place a rank waits ({DOC})"
    )


class _BlockInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, entered: threading.Event, release: threading.Event) -> torch.Tensor:
        ctx.events = (entered, release)
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        entered, release = ctx.events
        entered.set()
        release.wait(10)  # as a rank waits in DDP's gradient all-reduce
        return grad, None, None


def test_a_thread_blocked_inside_backward_shows_the_engine_frame_hangs_recognises() -> None:
    entered, release = threading.Event(), threading.Event()
    weight = torch.ones(3, requires_grad=True)

    def backward() -> None:
        _BlockInBackward.apply(weight * 2, entered, release).sum().backward()

    frames = _stack_of_a_thread_blocked_in(backward, entered, release)
    engine = [frame for frame in frames if frame.name == "_engine_run_backward"]
    assert engine and hangs.is_library(engine[0].filename), (
        f"a thread blocked inside loss.backward() no longer shows torch's _engine_run_backward frame "
        f"({[frame.name for frame in frames]}): app/cluster/hangs.py call_site looks for it by name to say a "
        f"rank waits in DDP's gradient all-reduce ({DOC})"
    )
    assert hangs.call_site(frames) == "DDP gradient all-reduce in loss.backward()", hangs.call_site(frames)


# ----- A private module's name in a warnings filter (app/run/console.py) -----


def test_lightnings_pytree_module_still_triggers_the_torch_warning_quiet_console_filters() -> None:
    from lightning.pytorch.utilities._pytree import _tree_flatten

    pytree_file = os.path.join("lightning", "pytorch", "utilities", "_pytree.py")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _tree_flatten({"x": torch.ones(1)})  # what Lightning's CombinedLoader calls on every batch
    from_pytree = [w for w in seen if w.filename.endswith(pytree_file)]
    assert from_pytree, (
        f"Lightning's {pytree_file} no longer triggers a torch deprecation warning: the filter on that "
        f"module in app/run/console.py quiet_console can go ({DOC})"
    )
    levels = {name: logging.getLogger(name).level for name in console.PER_RANK_LOGGERS}
    notices = {name: logging.getLogger(name).filters[:] for name in console.RANK_ZERO_LOGGERS}
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            console.quiet_console({})
            _tree_flatten({"x": torch.ones(1)})
    finally:  # quiet_console changes process-wide loggers: put them back
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for name, filters in notices.items():
            logging.getLogger(name).filters[:] = filters
    assert not [w for w in seen if w.filename.endswith(pytree_file)], (
        f"quiet_console's filter on module lightning.pytorch.utilities._pytree no longer silences "
        f"{[str(w.message) for w in seen]}: every rank prints it at its first batch ({DOC})"
    )


# ----- tests/helpers/host_reads.py (tests only) -----


def test_the_host_read_counter_still_sees_each_host_read_as_the_aten_op_it_lists() -> None:
    """A renamed op or a TorchDispatchMode that no longer sees it would let tests/test_host_reads.py pass
    while counting nothing; here each kind of read must be counted, and a deliberate host copy must not."""
    from tests.helpers.host_reads import HostReadCounter

    values = torch.tensor([1.0, 0.0, 1.0])
    reads = {
        ".item()": lambda: values[0].item(),
        "bool()": lambda: bool(values[0]),
        "torch.equal": lambda: torch.equal(values, values + 0),
        "nonzero": lambda: values.nonzero(),
        "masked_select": lambda: torch.masked_select(values, values > 0),
        "unique": lambda: torch.unique(values),
        "unique_consecutive": lambda: torch.unique_consecutive(values),
        "repeat_interleave": lambda: torch.repeat_interleave(values.long()),
    }
    unseen = []
    for name, read in reads.items():
        counter = HostReadCounter()
        counter.batch = (0, 0)
        with counter:
            read()
        if not counter.found[(0, 0)]:
            unseen.append(name)
    assert not unseen, (
        f"tests/helpers/host_reads.py HostReadCounter (torch.utils._python_dispatch.TorchDispatchMode and the aten "
        f"ops in HOST_READ_OPS) no longer sees {unseen}: tests/test_host_reads.py would miss those reads ({DOC})"
    )
    counter = HostReadCounter()
    counter.batch = (0, 0)
    with counter:
        torch.ones(1).to("cpu", copy=True).item()
    assert not counter.found[(0, 0)], f"a host copy's read was counted: {counter.found[(0, 0)]} ({DOC})"


# ----- strategy fsdp (app/parallel/fsdp.py, app/checkpoints/sharded.py) -----


def test_model_parallel_strategy_starts_its_process_group_in_the_method_fsdp_calls() -> None:
    source = inspect.getsource(ModelParallelStrategy._setup_distributed)
    assert "_init_dist_connection" in source and "self._timeout" in source, (
        "ModelParallelStrategy._setup_distributed no longer starts the process group with the strategy's timeout: "
        "FSDP2Strategy.setup_environment, which calls it once (before fit for --ckpt_path last), needs another "
        f"route ({DOC})"
    )


def test_lightning_module_device_mesh_returns_the_attribute_fsdp_sets() -> None:
    module, mesh = LightningModule(), object()
    module._device_mesh = mesh
    assert module.device_mesh is mesh, (
        "LightningModule.device_mesh no longer returns _device_mesh: a module's own configure_model under "
        f"strategy fsdp does not see FSDP2Strategy's mesh ({DOC})"
    )


def test_dcp_still_names_its_index_and_pickles_only_what_the_safe_reader_builds(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _metadata_fn

    assert _metadata_fn == DCP_INDEX, (
        f"DCP's index is now {_metadata_fn!r}: is_sharded_checkpoint looks for {DCP_INDEX!r} ({DOC})"
    )
    net = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.25)
    net(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process, as meant
        dcp.save({"state_dict": net.state_dict(), "optimizer_0": optimizer.state_dict()}, checkpoint_id=tmp_path)
        index = SafeFileSystemReader(tmp_path).read_metadata()  # a global the allowlist lacks fails here
        assert "state_dict.weight" in index.state_dict_metadata
        fresh = torch.optim.AdamW(net.parameters(), lr=1.0)
        net(torch.ones(1, 3)).sum().backward()
        fresh.step()
        target = {"optimizer_0": fresh.state_dict()}
        dcp.load(target, storage_reader=SafeFileSystemReader(tmp_path), planner=SafeLoadPlanner(), no_dist=True)
    assert target["optimizer_0"]["param_groups"][0]["lr"] == 0.25, (
        f"DefaultLoadPlanner.load_bytes no longer stores what SafeLoadPlanner hands it ({DOC})"
    )


def test_composable_activation_checkpointing_still_exists_and_keeps_parameter_names() -> None:
    import torch.distributed._composable as composable

    block = torch.nn.Sequential(torch.nn.Linear(2, 2))
    names = [name for name, _ in block.named_parameters()]
    composable.checkpoint(block)
    assert [name for name, _ in block.named_parameters()] == names, (
        "torch.distributed._composable.checkpoint now renames parameters: activation_checkpointing of strategy fsdp "
        f"would change every checkpoint's keys ({DOC})"
    )


# ----- At runtime (app/private_apis.py): a missing private API stops a run in one line -----


def test_a_missing_attribute_is_one_line_naming_the_api_the_installed_version_and_the_supported_range() -> None:
    with pytest.raises(PrivateApiChanged) as raised:
        require(_TrainingEpochLoop, "_renamed_in_a_future_lightning", "lightning", "last.ckpt's stop signals")
    message = one_line_message(raised.value)
    assert message is not None and "\n" not in message
    installed = importlib.metadata.version("lightning")
    api = "_TrainingEpochLoop._renamed_in_a_future_lightning"
    assert message.startswith(f"Lightning {installed} has no {api}"), message
    assert "lightning<2.7,>=2.6" in message and "Fix:" in message and DOC.split()[-1] in message, message


def test_a_fit_loop_state_without_a_key_exact_resume_rewrites_is_one_line_not_a_key_error(tmp_path: Path) -> None:
    _fit(tmp_path, _Counted(), [ExactResume(per_sample_seeding=False), _SaveThroughLightning(tmp_path)])
    checkpoint = torch.load(tmp_path / "mid-epoch.ckpt", weights_only=True)
    saved = checkpoint["loops"]["fit_loop"]
    del saved["epoch_loop.batch_progress"]  # what a Lightning that renamed it would have written
    position = DataPosition.from_checkpoint(saved_position(checkpoint))
    with pytest.raises(PrivateApiChanged, match=r"has no 'epoch_loop\.batch_progress' in the checkpoint's loops"):
        canonical_fit_loop_state(saved, position, validates=True)


# Runs ddp-app's entry point in a fresh process with one private API gone, as a Python without it
# would be: the run must stop before anything starts, in one line, exit code 2.
WITHOUT_API = """
import sys
{remove}
sys.argv = ["ddp-app", "fit", "--config", "configs/digits.yaml", "--trainer.default_root_dir={root}"]
from app.__main__ import main
main()
"""


@pytest.mark.more_cases
def test_ddp_app_without_a_private_api_stops_in_one_line_before_any_rank(tmp_path: Path) -> None:
    remove = "import atexit; del atexit._run_exitfuncs"
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_API.format(remove=remove, root=tmp_path)], capture_output=True, text=True,
        timeout=120, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [result.stderr.strip()], result.stderr[-3000:]  # one line, no traceback
    expected = f"ddp-app: error: Python {platform.python_version()} has no atexit._run_exitfuncs"
    assert result.stderr.startswith(expected) and "Fix:" in result.stderr, result.stderr
    assert not list(tmp_path.iterdir()), "nothing may be written before the check"


def test_a_tensors_version_counts_the_in_place_changes_overlap_copy_checks() -> None:
    """`Tensor._version` (app/checkpoints/plugin.py `version`): a state dict's view of a parameter sees
    every in-place change of the parameter that torch's autograd sees, an optimizer step's included;
    a change through `.data` is not counted (docs/resume.md says so)."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    view = model.state_dict()["weight"]
    assert isinstance(getattr(view, "_version", None), int), (
        f"torch {torch.__version__} has no Tensor._version: last_checkpoint.overlap_copy cannot tell a save whose "
        f"copy a parameter change tore from a good one (app/checkpoints/plugin.py `version`, {DOC})"
    )
    before = view._version
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    after_step = view._version
    with torch.no_grad():
        model.weight.clamp_(-0.1, 0.1)
    assert before < after_step < view._version, (
        f"Tensor._version no longer counts an optimizer step's and a no_grad clamp's in-place changes as seen "
        f"through a state dict's view ({before}, {after_step}, {view._version}): last_checkpoint.overlap_copy "
        f"would write a torn checkpoint without a word ({DOC})"
    )
    last = view._version
    model.weight.data.mul_(2)
    assert view._version == last, "a .data change is counted now: docs/resume.md can drop its caveat"


def test_a_dtensor_rebuilt_around_its_shards_host_copy_keeps_what_dcp_reads() -> None:
    """`DTensor.__tensor_flatten__` / `__tensor_unflatten__` (app/checkpoints/staging.py
    `HostStaging._copy_dtensor`): a background save under strategy fsdp copies each DTensor's local shard
    into a host buffer kept from save to save and rebuilds the DTensor around it. The rebuilt one must
    keep the mesh, placements, global shape and stride (what DCP's planner reads) and hold the buffer
    itself, on the host, with no copy of its own; the next save must reuse the buffer."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from app.checkpoints.staging import HostStaging

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(distribute_tensor(torch.randn(16, 8), mesh, [Shard(0)]))
        staging = HostStaging()
        staging.begin()
        first = staging.copy(weight)
        staging.finish()
        what = (
            f"torch {torch.__version__}'s DTensor flatten protocol changed: background saves under strategy fsdp "
            f"no longer stage a DTensor's shard into a kept host buffer (app/checkpoints/staging.py, {DOC})"
        )
        assert isinstance(first, DTensor), what
        assert (first.device_mesh, first.placements, first.shape, first.stride()) == (
            weight.device_mesh,
            weight.placements,
            weight.shape,
            weight.stride(),
        ), what
        local = first.to_local()
        assert local.device.type == "cpu" and local.data_ptr() != weight.to_local().data_ptr(), what
        assert torch.equal(local, weight.to_local()), what
        with torch.no_grad():
            weight.mul_(2.0)  # the next steps change the parameter, not the copy
        assert not torch.equal(first.to_local(), weight.to_local()), what
        staging.begin()
        again = staging.copy(weight)
        staging.finish()
        assert again.to_local().data_ptr() == local.data_ptr(), "the next save did not reuse the shard's host buffer"
        assert torch.equal(again.to_local(), weight.to_local()), what
    finally:
        dist.destroy_process_group()


def test_lightning_still_dumps_the_checkpoint_dict_a_replica_group_sends_a_peer(tmp_path: Path) -> None:
    """app/parallel/ft_manager.py sends `trainer._checkpoint_connector.dump_checkpoint()`, the dict
    `Trainer.save_checkpoint` writes, to a replica group that heals."""
    assert "self._checkpoint_connector.dump_checkpoint(" in inspect.getsource(Trainer.save_checkpoint), (
        f"Trainer.save_checkpoint no longer writes dump_checkpoint's dict: a healing group may receive another "
        f"state than a save writes ({DOC})"
    )
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = Trainer(
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    trainer.fit(BoringModel())
    dumped = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    assert {"state_dict", "optimizer_states", "loops", "callbacks", "global_step"} <= dumped.keys(), (
        f"dump_checkpoint's dict lacks what a healing group resumes from ({DOC})"
    )


def test_torchft_manager_still_records_the_quorum_id_the_quorum_change_line_reads() -> None:
    pytest.importorskip("torchft")
    from torchft.manager import Manager

    assert "self._quorum_id = quorum_id" in inspect.getsource(Manager._async_quorum), (
        f"torchft's Manager no longer keeps its quorum's id in _quorum_id: the line that says the quorum of "
        f"replica groups changed (app/parallel/ft_manager.py) would never print ({DOC})"
    )


def test_lightning_still_says_during_backward_whether_it_ends_in_an_optimizer_step(tmp_path: Path) -> None:
    """app/parallel/ft_buckets.py starts the groups' gradient all-reduces during the backward of the
    micro-batch that ends in an optimizer step, and only then: `trainer.fit_loop._should_accumulate()`,
    asked during backward, must be False exactly for the batches whose backward an optimizer step follows
    (with accumulation, and at an epoch's last batch that closes a short accumulation)."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Recorder(Callback):
        def __init__(self) -> None:
            self.batch = -1
            self.sending: list[int] = []
            self.stepped: list[int] = []

        def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.batch += 1

        def on_after_backward(self, trainer: Trainer, pl_module: Any) -> None:
            if not trainer.fit_loop._should_accumulate():
                self.sending.append(self.batch)

        def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
            self.stepped.append(self.batch)

    recorder = Recorder()
    trainer = Trainer(
        max_epochs=2, limit_train_batches=7, limit_val_batches=0, accumulate_grad_batches=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path, callbacks=[recorder],
    )  # fmt: skip
    trainer.fit(BoringModel())
    assert recorder.stepped == [2, 5, 6, 9, 12, 13], recorder.stepped
    assert recorder.sending == recorder.stepped, (
        f"Lightning's fit_loop._should_accumulate() no longer says during backward which batches end in an "
        f"optimizer step ({recorder.sending} against {recorder.stepped}): fault tolerance would all-reduce "
        f"the wrong micro-batches' gradients ({DOC})"
    )


def test_env_rendezvous_still_makes_every_rank_a_client_of_the_store_at_the_agents_address() -> None:
    """app/cluster/rendezvous.py: a launcher holds the port and one process serves the store on it; every rank,
    rank 0 too, must then connect as a client. Here another process serves it (in this process, TCPStore's
    multi-tenancy would reuse the server and hide the difference); a torch that made rank 0 the server again would
    fail to bind the held port."""
    from app.cluster.rendezvous import held_ports_variables, hold_free_port, serve_held

    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the package's attribute is the function
    assert hasattr(rendezvous, "_agent_store_serves"), "torch's env:// rendezvous lost `_agent_store_serves`"
    with hold_free_port() as held:
        variables = held_ports_variables({"MASTER_PORT": held})
        server = os.fork()
        if server == 0:  # serves the store on the inherited socket until killed
            try:
                serve_held(dict(variables), serves=True)
                time.sleep(120)
            finally:
                os._exit(0)
    try:
        environment = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": variables["MASTER_PORT"]}
        with pytest.MonkeyPatch.context() as patch:
            for name, value in {**environment, "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
                patch.setenv(name, value)
            store, rank, world_size = next(rendezvous.rendezvous("env://", rank=0, world_size=1))
            store.set("from rank 0", "as a client")
        assert (rank, world_size) == (0, 1)
        assert store.get("from rank 0") == b"as a client"
    finally:
        os.kill(server, signal.SIGKILL)
        os.waitpid(server, 0)


def test_multiprocessing_still_forks_through_the_launch_and_bootstrap_a_worker_check_overrides() -> None:
    """app/data/worker_fork.py overrides `popen_fork.Popen._launch` (waits for the child's first line) and
    `BaseProcess._bootstrap` (writes it): `_launch` must fork and call `_bootstrap(parent_sentinel=...)` in the
    child."""
    import inspect
    import multiprocessing.popen_fork
    import multiprocessing.process

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from app.data.worker_fork import FIRST_LINE_FORK

    launch = inspect.getsource(multiprocessing.popen_fork.Popen._launch)
    assert "os.fork()" in launch and "_bootstrap(parent_sentinel=" in launch, (
        f"CPython {platform.python_version()} changed multiprocessing.popen_fork.Popen._launch: the DataLoader workers "
        f"of a rank on CPython < 3.12 (app/data/worker_fork.py) would no longer be checked for a fork that hung ({DOC})"
    )
    assert "parent_sentinel" in inspect.signature(multiprocessing.process.BaseProcess._bootstrap).parameters, (
        f"CPython {platform.python_version()} changed BaseProcess._bootstrap: app/data/worker_fork.py ({DOC})"
    )
    data = TensorDataset(torch.arange(8.0))
    loader = DataLoader(data, batch_size=2, num_workers=2, multiprocessing_context=FIRST_LINE_FORK)
    assert sorted(value for batch in loader for value in batch[0].tolist()) == list(range(8)), (
        f"a DataLoader worker forked through app/data/worker_fork.py no longer runs the worker loop ({DOC})"
    )
