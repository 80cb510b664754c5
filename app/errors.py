"""One place that turns an exception into the one line a user reads, or decides it is a bug.

Every entry point prints `ddp-app: error: <line>` and exits 2 for the user's problems: our `UserFacingError` family and
errors we recognise (parser and Lightning configuration errors, a full disk, a lost peer, a failed rendezvous, a
checkpoint of another model). Anything else keeps its traceback; `DDP_APP_TRACEBACK=1` prints it before the line too. No
Lightning here."""

from __future__ import annotations

import errno
import os
import re
import sys
import traceback

TRACEBACK_VARIABLE = "DDP_APP_TRACEBACK"


class UserFacingError(RuntimeError):
    """An error whose message already says what is wrong and how to fix it."""


class ResumeError(UserFacingError):
    """A checkpoint whose position cannot be continued exactly by this run; one line says why."""


class InvalidConfigError(UserFacingError, ValueError):
    """A config value out of its range. Also a ValueError, which is what callers validating input expect."""


class TrainerArgumentError(UserFacingError):
    """A `trainer.*` value that Lightning refuses, or would accept and then fail on during training."""


class NonFiniteLossError(UserFacingError):
    """The gradients became NaN/Inf.

    No checkpoint holds weights updated with them (app.run.callbacks.NonFiniteGuard)."""


def summarize_parser_error(message: str) -> str:
    """Turn jsonargparse's multi-line report into one line that names the key and what is wrong."""
    missing_config = re.search(r'Parser key "config":\s*File does not exist: (.*)', message)
    if missing_config:
        path = missing_config.group(1).strip().strip("'\"")
        return (
            f"config file {path} does not exist. Fix: check the path (relative to the current directory, "
            f"{os.getcwd()}), e.g. --config configs/digits.yaml from the repository's top."
        )
    keys = re.findall(r'(?:Parser key|Key) "([^"]+)"', message)
    # A key inside a `class_path` object is reported relative to it: rebuild the full path.
    path = keys[0] + "".join(f".init_args.{key}" for key in keys[1:]) if keys else None
    wrong_type = re.search(r"Expected a <class '([^']+)'>\. Got value: (.*)", message)
    if path and wrong_type:
        return f"invalid value {wrong_type.group(2).strip()!r} for {path}: expected {wrong_type.group(1)}."
    given = re.search(r"Given value: (.*)", message)
    nested = re.search(r"NestedArg\(key='([^']+)', val=", given.group(1)) if path and given else None
    if nested:  # `--trainer.strategy NAME --trainer.strategy.init_args.KEY V`: the class has no KEY
        return (
            f"unknown key {path}.init_args.{nested.group(1)}: that class has no such argument. Fix: remove it or "
            f"check its spelling (ddp-app fit --{path}.help CLASS lists the accepted keys)."
        )
    expected = [name for name in re.findall(r"Expected a <class '([^']+)'>", message) if name != "NoneType"]
    # A choice among fixed values (`precision: 17`): list them, with any plain type the key also takes.
    choices = [
        choice.strip()
        for listed in re.findall(r"Expected a typing\.Literal\[(.*)\]", message)
        for choice in listed.split(",")
    ]
    if path and given and (expected or choices) and "Namespace(" not in given.group(1):
        wanted = " or ".join(dict.fromkeys(expected))
        if choices:
            wanted = f"one of {', '.join(dict.fromkeys(choices))}" + (f", or {wanted}" if wanted else "")
        return f"invalid value {given.group(1).strip()!r} for {path}: expected {wanted}."
    class_path_error = _class_path_error(path, message)
    if class_path_error:
        return class_path_error
    not_accepted = re.search(r"Option '([^']+)' is not accepted", message)
    if not_accepted and path:
        return (
            f"unknown key {path}.init_args.{not_accepted.group(1)}: that class has no such argument. "
            "Fix: check its spelling (--help lists the accepted keys)."
        )
    if "unrecognized arguments" in message:
        return f"{message.strip()}: no such key. Fix: check its spelling and nesting (init_args)."
    if "Problems parsing config" in message or "while parsing" in message or "while scanning" in message:
        return _yaml_syntax_error(message, _config_file_being_read())
    reasons = [
        line.strip()[2:]
        for line in message.splitlines()
        if line.strip().startswith("- ") and "NoneType" not in line and "Problem with given class_path" not in line
    ]
    if reasons:
        return reasons[0] if not path or path in reasons[0] else f"{path}: {reasons[0]}"
    return " ".join(message.split())


def _yaml_syntax_error(message: str, config_file: str | None) -> str:
    """`configs/x.yaml is not valid YAML: line 2, column 15: while parsing a flow sequence; ...`."""
    parts, lines = [], []
    for line in message.replace("Problems parsing config: ", "").splitlines():
        mark = re.match(r'\s*in "[^"]*", line (\d+), column (\d+)', line)
        if mark:
            lines.append(mark.group(1))
            parts[-1:] = [f"line {mark.group(1)}, column {mark.group(2)}: {parts[-1]}" if parts else ""]
        elif line.strip():
            parts.append(line.strip())
    detail = "; ".join(part for part in parts if part)[:240]
    where = config_file or "a config file"
    at = f" at line {lines[-1]}" if lines else ""
    fix_in = f" of {config_file}" if config_file and at else (f" in {config_file}" if config_file else " there")
    return f"{where} is not valid YAML: {detail}. Fix: correct the YAML syntax{at}{fix_in}."


def _config_file_being_read() -> str | None:
    """The config file jsonargparse was reading when it reported a YAML error (innermost of its private
    `config_load_stack`, docs/private_apis.md); tests/test_errors.py fails if a release drops it."""
    util = sys.modules.get("jsonargparse._util")
    stack_variable = getattr(util, "config_load_stack", None)
    stack = stack_variable.get() if stack_variable is not None else ()
    return stack[-1][1] if stack else None


def _class_path_error(path: str | None, message: str) -> str | None:
    """A `class_path` that did not import, names no class, or names a class of the wrong kind."""
    given = re.search(r"Given value: (\S+)", message)
    problem = re.search(r"Problem with given class_path '([^']+)':\s*\n\s*(.+)", message)
    bare_name = re.search(r"Expected a dot import path string: (\S+)", message)
    wrong_kind = "Import path does not correspond to a subclass" in message
    if not path or not (problem or bare_name or (wrong_kind and given)):
        return None
    from app.user_code import explain_class_path_error

    subtypes = re.search(r"Subtypes: \[<class '([^']+)'>", message)
    base = subtypes.group(1) if subtypes else None
    if base and base.startswith("lightning.pytorch.core."):
        base = "lightning.pytorch." + base.rpartition(".")[2]
    if problem:
        return explain_class_path_error(path, problem.group(1), problem.group(2), base)
    if bare_name:
        return explain_class_path_error(path, bare_name.group(1), bare_name.group(0), base)
    reason = next(line.strip() for line in message.splitlines() if "does not correspond to a subclass" in line)
    return explain_class_path_error(path, given.group(1), reason, base)


# What gloo (and NCCL's TCP store) report when a peer process disappears mid-collective.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed")
LOST_ANOTHER_RANK = "lost the connection to another rank"


def _this_rank() -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return f"rank {dist.get_rank()}"
    return f"rank {os.environ.get('RANK', os.environ.get('LOCAL_RANK', '?'))}"


def _gloo_reason(text: str) -> str:
    match = re.search(r"\] ([^\n]*?(?:by peer|Broken pipe|Socket closed)[^.\n]*)", text)
    return match.group(1) if match else next(sign for sign in PEER_LOST if sign in text)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _is_lightning_misconfiguration(error: BaseException) -> bool:
    # Looked up, not imported: if Lightning is not loaded, the error cannot be one of its own.
    exceptions = sys.modules.get("lightning.fabric.utilities.exceptions")
    return exceptions is not None and isinstance(error, exceptions.MisconfigurationException)


# Lightning's modules that validate the Trainer's arguments and raise a plain ValueError for a bad one
# (`accelerator="quantum"`, an unknown strategy or precision name).
LIGHTNING_INPUT_CHECKS = ("lightning/pytorch/trainer/connectors/", "lightning/fabric/connector.py")


def _raised_in(error: BaseException, places: tuple[str, ...]) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and any(place in frames[-1].filename.replace(os.sep, "/") for place in places)


def user_message(error: BaseException) -> str | None:
    """The one-line message for an error the user can fix, or None for a bug (keep the traceback); with
    `DDP_APP_TRACEBACK=1` the traceback is printed first."""
    message = one_line_message(error)
    if message is not None and os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
        traceback.print_exception(error, file=sys.stderr)
    return message


def one_line_message(error: BaseException) -> str | None:
    """What `user_message` returns, without printing anything."""
    text = str(error)
    if isinstance(error, UserFacingError):
        return _one_line(text)
    if _is_lightning_misconfiguration(error):
        return _one_line(text)
    if isinstance(error, ValueError) and _raised_in(error, LIGHTNING_INPUT_CHECKS):
        return _one_line(text)
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        where = f" while writing {error.filename}" if error.filename else ""
        return f"no space left on the device{where}. Fix: free space or point trainer.default_root_dir elsewhere."
    if "Error(s) in loading state_dict" in text:
        first = next((line.strip() for line in text.splitlines()[1:] if line.strip()), "")
        return f"the checkpoint does not fit this model: {first} Fix: use the config it was trained with."
    if any(sign in text for sign in PEER_LOST):
        return (
            f"{_this_rank()}: {LOST_ANOTHER_RANK}, which died or was killed "
            f"({_gloo_reason(text)}); this rank stops too. The failed rank's own output says why."
        )
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return (
            "MASTER_PORT is already in use on this machine. Fix: unset MASTER_PORT to let the launcher pick a "
            "free port, or choose another one."
        )
    if type(error).__name__ in ("DistNetworkError", "DistStoreError") or "Connection refused" in text:
        address = os.environ.get("MASTER_ADDR", "?")
        port = os.environ.get("MASTER_PORT", "?")
        return (
            f"could not reach the rendezvous at MASTER_ADDR={address} MASTER_PORT={port} "
            f"({_one_line(text.splitlines()[0] if text else type(error).__name__)[:160]}). "
            "Fix: check that rank 0 runs, the address is reachable from this node and the port is open."
        )
    if _raised_in(error, PARSER):
        # jsonargparse wraps what a constructor raised while it checks the config. Our own input error keeps its line, a
        # parser complaint gets one, and a bug in a user's class its traceback.
        root = _root_cause(error)
        if isinstance(root, UserFacingError):
            return _one_line(str(root))
        if root is error or _raised_in(root, PARSER):
            return summarize_parser_error(text)
    return None


PARSER = ("jsonargparse/", "argparse.py")


def failed_because_a_peer_died(error: BaseException) -> bool:
    """Whether this rank stops only because another one died: one line, but not bad input, so it exits with its own code
    and a restart or requeue is worth it."""
    message = one_line_message(error)
    return message is not None and LOST_ANOTHER_RANK in message


def _root_cause(error: BaseException) -> BaseException:
    seen = {id(error)}
    while (cause := error.__cause__ or error.__context__) is not None and id(cause) not in seen:
        seen.add(id(cause))
        error = cause
    return error
