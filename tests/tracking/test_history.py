"""The run history decides which logged values a tracker may keep: none twice, none lost, the last
attempt's where a resume redid a step. Replayed by hand here, event by event, as attempts make them."""

from __future__ import annotations

import csv
from pathlib import Path

from app.tracking.history import SETTLED, Journal, RunHistory, replay
from app.tracking.sinks import CsvView


def values(history: RunHistory, state: str | None = None) -> dict[tuple[str, int], float]:
    return {
        (name, call.step): value
        for call in history.view()
        if state is None or call.state == state
        for name, value in call.values.items()
    }


def test_values_logged_before_a_completed_save_settle_and_later_ones_wait() -> None:
    history = RunHistory()
    history.log(9, {"loss": 2.0}, 0.0)
    history.log(19, {"loss": 1.5}, 0.0)
    seq = history.last_seq
    history.log(29, {"loss": 1.2}, 0.0)
    settled = history.saved(seq, 19)
    assert [(call.step, call.values) for call in settled] == [(9, {"loss": 2.0}), (19, {"loss": 1.5})]
    assert values(history, SETTLED) == {("loss", 9): 2.0, ("loss", 19): 1.5}


def test_a_resume_replaces_the_dead_attempts_values_after_its_checkpoint() -> None:
    history = RunHistory()
    history.log(9, {"loss": 2.0}, 0.0)
    history.log(19, {"loss": 1.5}, 0.0)
    checkpoint = (history.last_seq, 19)
    history.log(29, {"loss": 9.9}, 0.0)  # after the checkpoint; the attempt then died
    history.resumed(*checkpoint)
    _, replaced = history.log(29, {"loss": 1.2}, 0.0)  # the resumed attempt redoes step 29
    assert replaced
    history.finished()
    assert values(history) == {("loss", 9): 2.0, ("loss", 19): 1.5, ("loss", 29): 1.2}


def test_a_value_logged_after_the_epoch_end_save_is_kept_though_no_resume_logs_it_again() -> None:
    """Lightning logs the epoch's on_epoch values after the epoch-end checkpoint; a resume from that
    checkpoint starts the next epoch and never logs them again."""
    history = RunHistory()
    history.log(19, {"loss": 1.5}, 0.0)
    epoch_end = (history.last_seq, 19)
    history.log(19, {"train_acc": 0.7}, 0.0)  # after the save
    history.log(29, {"loss": 9.9}, 0.0)
    history.resumed(*epoch_end)  # the attempt died in the next epoch
    assert values(history, SETTLED) == {("loss", 19): 1.5}
    history.log(29, {"loss": 1.2}, 0.0)
    history.log(39, {"loss": 1.0}, 0.0)
    history.saved(history.last_seq, 39)  # the resumed attempt has logged past step 19: train_acc is final
    assert values(history, SETTLED) == {("loss", 19): 1.5, ("train_acc", 19): 0.7, ("loss", 29): 1.2, ("loss", 39): 1.0}


def test_a_provisional_value_waits_until_the_resumed_attempt_passes_its_step() -> None:
    history = RunHistory()
    history.log(9, {"loss": 2.0}, 0.0)
    checkpoint = (history.last_seq, 9)
    history.log(19, {"loss": 9.9}, 0.0)
    history.log(29, {"loss": 8.8}, 0.0)
    history.resumed(*checkpoint)
    history.log(19, {"loss": 1.5}, 0.0)
    history.saved(history.last_seq, 19)  # saved at step 19: step 29 may still be redone
    assert ("loss", 29) not in values(history, SETTLED)
    history.log(29, {"loss": 1.2}, 0.0)
    history.finished()
    assert values(history) == {("loss", 9): 2.0, ("loss", 19): 1.5, ("loss", 29): 1.2}


def test_two_deaths_before_any_new_save_keep_only_the_last_attempts_values() -> None:
    history = RunHistory()
    history.log(9, {"loss": 2.0}, 0.0)
    checkpoint = (history.last_seq, 9)
    history.log(19, {"loss": 9.9}, 0.0)
    history.resumed(*checkpoint)
    history.log(19, {"loss": 8.8}, 0.0)
    history.resumed(*checkpoint)  # the second attempt died too, before saving
    history.log(19, {"loss": 1.5}, 0.0)
    history.finished()
    assert values(history) == {("loss", 9): 2.0, ("loss", 19): 1.5}


def test_the_journal_replays_to_the_same_state(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.jsonl")
    live = RunHistory()
    events = [
        {"seq": 1, "step": 9, "time": 0.0, "values": {"loss": 2.0}},
        {"saved": 1, "step": 9},
        {"seq": 2, "step": 19, "time": 0.0, "values": {"loss": 9.9, "epoch": 0.0}},
        {"resumed": 1, "step": 9},
        {"seq": 3, "step": 19, "time": 0.0, "values": {"loss": 1.5}},
    ]
    for event in events:
        journal.append(event)
        live.apply(event)
    journal.close()
    with (tmp_path / "journal.jsonl").open("a") as file:
        file.write('{"seq": 4, "st')  # a line cut short by a crash
    replayed = replay(tmp_path / "journal.jsonl")
    assert values(replayed) == values(live) == {("loss", 9): 2.0, ("epoch", 19): 0.0, ("loss", 19): 1.5}
    assert replayed.last_seq == 3


def test_metrics_csv_never_holds_two_values_for_one_name_and_step(tmp_path: Path) -> None:
    history = RunHistory()
    view = CsvView(tmp_path)
    for step, loss in ((9, 2.0), (19, 9.9)):
        call, _ = history.log(step, {"loss": loss}, 0.0)
        view.append(call, history.view())
    history.resumed(1, 9)
    call, replaced = history.log(19, {"loss": 1.5, "acc": 0.5}, 0.0)
    assert replaced
    view.rewrite(history.view())
    with (tmp_path / "metrics.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert rows == [{"acc": "", "loss": "2.0", "step": "9"}, {"acc": "0.5", "loss": "1.5", "step": "19"}]


def test_which_run_an_attempt_belongs_to(tmp_path: Path) -> None:
    from app.tracking.attempt import run_identity, write_identity

    logs = tmp_path / "lightning_logs"
    first, seq, step = run_identity(logs, None, continue_latest=False)
    assert (first["log_version"], seq, step) == ("version_0", 0, -1)
    write_identity(logs / "version_0", first)
    # A resume from one of this directory's checkpoints continues its run, from the checkpoint's position.
    state = {"run_id": first["run_id"], "log_version": "version_0", "seq": 7, "step": 39}
    assert run_identity(logs, state, continue_latest=False) == (first, 7, 39)
    # `--ckpt_path last` before any checkpoint: the directory's latest run, nothing of it final yet.
    assert run_identity(logs, None, continue_latest=True) == (first, 0, -1)
    # A checkpoint of another directory's run (fine-tuning), or a fresh fit: a new run, a new version.
    foreign = {"run_id": "elsewhere", "log_version": "version_0", "seq": 3, "step": 9}
    for other, continue_latest in ((foreign, False), (None, False)):
        new, seq, step = run_identity(logs, other, continue_latest)
        assert new["run_id"] != first["run_id"] and new["log_version"] == "version_1" and (seq, step) == (0, -1)
