"""standalone_context from several threads of one process (the WAN meter computes closed forms, which build the
model on the meta device, from its --jobs threads): the lone-rank variables are the process's, so one thread's
must never be seen or removed by another (a 45-run meter batch once ended in KeyError: 'WORLD_SIZE'). And a
process that asks again gets the same groups: each new context's gloo groups kept three threads each until the
process ended (a pytest worker that ran the dry-run presets held 1,228 threads, polling for a third of a core)."""
from __future__ import annotations

import os
import threading
import time


def test_threads_building_standalone_contexts_never_share_the_lone_rank_variables(monkeypatch) -> None:
    from nanotron_ext.parallel import context

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(context, "_BUILT", {})
    inside, overlapped, seen = [0], [], []

    def build(dp: int, tp: int, pp: int, **kw) -> object:  # stands in for the process groups; slow enough to overlap
        inside[0] += 1
        overlapped.append(inside[0] > 1)
        time.sleep(0.05)
        seen.append((os.environ.get("RANK"), os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_RANK")))
        inside[0] -= 1
        return object()

    monkeypatch.setattr(context, "build_parallel_context", build)
    monkeypatch.setattr(context, "init_portless", lambda *a, **k: None)
    monkeypatch.setattr(context.torch_dist, "is_initialized", lambda: False)
    threads = [threading.Thread(target=context.standalone_context) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen == [("0", "1", "0")] * 4 and not any(overlapped)
    assert not any(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))  # nothing left behind


def test_a_launched_rank_keeps_its_own_variables(monkeypatch) -> None:
    from nanotron_ext.parallel import context

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(context, "_BUILT", {})
    got = []
    monkeypatch.setattr(context, "build_parallel_context",
                        lambda *a, **k: got.append((os.environ["RANK"], os.environ["WORLD_SIZE"])) or object())
    context.standalone_context()
    assert got == [("3", "4")]


def test_asking_again_reuses_the_groups_while_their_default_group_lives(monkeypatch) -> None:
    from nanotron_ext.parallel import context

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(context, "_BUILT", {})
    first = context.standalone_context()
    threads = len(os.listdir("/proc/self/task"))
    assert all(context.standalone_context() is first for _ in range(3))
    assert len(os.listdir("/proc/self/task")) == threads  # no new gloo threads
    stale = object()  # a context built on a default group that has since been destroyed and made again
    monkeypatch.setitem(context._BUILT, (1, "gloo"), (object(), stale))
    rebuilt = context.standalone_context()
    assert rebuilt is not stale and rebuilt is not first and context.standalone_context() is rebuilt


def _threads_around_a_world_of_one() -> tuple:
    from nanotron_ext.inference.model import one_process_group
    from nanotron_ext.parallel.context import standalone_context

    def names() -> list:
        return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))

    before = names()
    with one_process_group():
        standalone_context()  # kept by standalone_context for the next caller while the group lives
    return before, names()


def test_a_world_of_one_closed_again_leaves_no_gloo_thread() -> None:
    """generate/eval's one_process_group: on the way out its groups, and the context standalone_context kept on
    them, are released, so their gloo threads end then, not at interpreter exit."""
    from tests.helpers.dist import run_distributed

    before, after = run_distributed(_threads_around_a_world_of_one, 1)[0]
    assert after == before
