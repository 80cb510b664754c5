"""The `ddp-app` command: LightningCLI over the models in `app.models` and data in `app.data`.

    ddp-app fit --config configs/digits.yaml [--trainer.max_epochs 5 ...]
    python -m app fit --config configs/digits.yaml

With `strategy: ddp`, Lightning starts ranks >= 1 by running this same command line again when
rank 0 reaches `fit`. Everything before `fit` (parsing, building the model and data module)
therefore runs once per rank: nothing here may download or write.
"""

from __future__ import annotations

import re
import sys
from typing import NoReturn

import lightning as L
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.loggers.tensorboard import _TENSORBOARD_AVAILABLE

import app.data  # noqa: F401  (registers the DataModules for short `class_path` names)
import app.models  # noqa: F401  (registers the LightningModules)
from app.checkpoints import CheckpointError, SafeCheckpointIO
from app.cluster.threads import configure_cpu_threads
from app.data.base import DataNotFoundError


def summarize_error(message: str) -> str:
    """Turn jsonargparse's multi-line report into one line that names the key and what is wrong."""
    keys = re.findall(r'(?:Parser key|Key) "([^"]+)"', message)
    # A key inside a `class_path` object is reported relative to it: rebuild the full path.
    path = keys[0] + "".join(f".init_args.{key}" for key in keys[1:]) if keys else None
    wrong_type = re.search(r"Expected a <class '([^']+)'>\. Got value: (.*)", message)
    if path and wrong_type:
        return f"invalid value {wrong_type.group(2).strip()!r} for {path}: expected {wrong_type.group(1)}."
    given = re.search(r"Given value: (.*)", message)
    expected = [name for name in re.findall(r"Expected a <class '([^']+)'>", message) if name != "NoneType"]
    if path and given and expected and "Namespace(" not in given.group(1):
        wanted = " or ".join(dict.fromkeys(expected))
        return f"invalid value {given.group(1).strip()!r} for {path}: expected {wanted}."
    if "unrecognized arguments" in message:
        return f"{message.strip()}: no such key. Fix: check its spelling and nesting (init_args)."
    reasons = [
        line.strip()[2:]
        for line in message.splitlines()
        if line.strip().startswith("- ") and "NoneType" not in line and "Problem with given class_path" not in line
    ]
    if reasons:
        return reasons[0] if not path or path in reasons[0] else f"{path}: {reasons[0]}"
    return " ".join(message.split())


class OneLineErrorParser(LightningArgumentParser):
    """Bad command-line or config input: one line on stderr and exit code 2, not a 60-line usage dump."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        prog = self.prog.replace(" [options]", "")
        sys.stderr.write(f"{prog}: error: {summarize_error(message)} (see: {prog} --help)\n")
        self.exit(2)


def default_loggers(root_dir: str) -> list[Logger]:
    """CSV metrics always (easy to read in tests and scripts); TensorBoard too when it is installed."""
    csv_logger = CSVLogger(save_dir=root_dir)
    loggers: list[Logger] = [csv_logger]
    if _TENSORBOARD_AVAILABLE:
        loggers.append(TensorBoardLogger(save_dir=root_dir, version=csv_logger.version))
    return loggers


class DDPAppCLI(LightningCLI):
    """LightningCLI with our defaults: one-line errors, CSV (+TensorBoard) logs, config saved
    next to the logs and overwritten when a requeued job starts again in the same directory."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_class", OneLineErrorParser)
        super().__init__(
            L.LightningModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            **kwargs,
        )

    def instantiate_trainer(self, **kwargs) -> Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = SafeCheckpointIO()
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        if config["trainer"]["logger"] in (None, True):
            trainer.loggers = default_loggers(trainer.default_root_dir)
        return trainer


# Errors that are the user's to fix: printed as one line, without a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (CheckpointError, DataNotFoundError, ValueError, FileNotFoundError)


def main(args: list[str] | None = None) -> None:
    configure_cpu_threads()
    try:
        DDPAppCLI(args=args)
    except USER_ERRORS as error:
        print(f"ddp-app: error: {summarize_error(str(error))}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
