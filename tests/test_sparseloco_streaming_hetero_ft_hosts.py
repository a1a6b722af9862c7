"""ft_hosts' streaming and lost-host additions (ft_hosts_fault.py) on hand-written inputs: its flags' refusals, the
lighthouse's quorums read back as the membership schedule, a relaunched replica's metrics (steps logged twice: the
last kept), a streaming sync's extra bytes over its send and arrival steps, and the clock's tau bound."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanotron_ext.sparseloco.ft_hosts import main, replica_row
from nanotron_ext.sparseloco.ft_hosts_fault import quorums, streaming_clock

QUORUM = ('2026-12-07T22:06:40.632 [INFO] [torchft::lighthouse] - Quorum! Quorum { quorum_id: 2, participants: '
          '[QuorumMember { replica_id: "sparseloco_0:05aa", address: "http://10.77.0.1:40969", store_address: '
          '"10.77.0.1:35337", step: 1, world_size: 4, shrink_only: false, commit_failures: 0, data: "" }, '
          'QuorumMember { replica_id: "sparseloco_1:4dc0", address: "http://10.77.0.2:41263", store_address: '
          '"10.77.0.2:29500", step: 0, world_size: 4, shrink_only: false, commit_failures: 0, data: "" }], created: '
          'Some(Timestamp { seconds: 1, nanos: 2 }) }')


@pytest.mark.parametrize("argv,says", [
    (["--streaming-delay", "5"], "--streaming-delay 5: must be below --inner-steps 5"),
    (["--kill-host", "2"], "--kill-host and --kill-at-step go together"),
    (["--kill-host", "3", "--kill-at-step", "7"], "--kill-host 3: the job has hosts 0, 1 and 2"),
    (["--kill-host", "1", "--kill-at-step", "5"], "--kill-at-step 5: must be after the first checkpoint"),
])
def test_bad_flags_are_refused_in_one_line(argv, says, capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_quorums_read_members_and_their_steps() -> None:
    log = "\n".join(["noise", QUORUM, QUORUM.replace('"sparseloco_1:4dc0"', '"sparseloco_0:x"')])
    assert quorums(log) == [{0: 1, 1: 0}, {0: 0}]  # one replica listed twice in the second: its last entry


def test_a_relaunched_streaming_replica_keeps_each_steps_last_loss(tmp_path: Path) -> None:
    """H = 3, tau = 1: sends at 3 and 6 (ft bytes), arrivals at 4 and 7 (the fold's tp bytes); steps 4-5 logged
    twice (killed in step 6, resumed from the step-3 checkpoint)."""
    inner = {"tp": 100, "pp": 70, "pp:send:fwd": 30, "pp:send:bwd": 30}
    send, arrive = {**inner, "ft": 40}, {**inner, "tp": 150}
    steps = [1, 2, 3, 4, 5, 4, 5, 6, 7]
    rows = [{"step": s, "loss": 9.0 - s - 0.5 * (i >= 5), "step_time_s": 0.5,
             "comm_bytes": send if s % 3 == 0 else arrive if s % 3 == 1 and s > 1 else inner}
            for i, s in enumerate(steps)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"final_val_loss": 2.5}))
    row = replica_row(tmp_path, 3, {}, delay=1)
    assert row["steps_logged"] == [1, 2, 3, 4, 5, 6, 7]
    assert row["losses"] == [8.0, 7.0, 6.0, 4.5, 3.5, 2.5, 1.5] and row["replayed"] == {4: 5.0, 5: 4.0}
    assert row["ledger_sync_extra_bytes"] == {"tp": 50, "pp": 0, "ft": 40}


def test_streaming_bound_hides_the_sync_behind_tau_steps_only() -> None:
    """A 0.5 s sync (1.25 MB at 20 Mbit/s), H = 5, a 0.2 / 0.3 s step: blocking hides it behind 5 steps (1.0 s,
    full overlap 0.2) or stops for it (0.3 + 0.5 / 5); streaming with tau = 1 waits 0.5 - 0.2 once a cycle."""
    row = {"clock": {"clock_step_s": {"full_overlap": 0.2, "no_overlap": 0.3}},
           "ledger_sync_extra_bytes": {"ft": 1_250_000}}
    c = streaming_clock(row, 20.0, 5, 1)
    assert c["outer_sync_wire_s"] == pytest.approx(0.5)
    assert c["blocking"]["full_overlap"] == pytest.approx(0.2) and c["blocking"]["no_overlap"] == pytest.approx(0.4)
    assert c["streaming_tau"]["full_overlap_behind_tau"] == pytest.approx(0.2 + 0.3 / 5)
