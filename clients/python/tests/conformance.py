"""The client libraries' WORKLOAD (tests/client_libraries.rs says what it is and checks the
totals in PostgreSQL) with tallyd_client, against a real tallyd.

    python3 conformance.py SOCKET TAG N

Prints `kill` when the daemon is to be killed with SIGKILL (the driver answers `killed` on
stdin, then starts it again), `batches: ran` or `batches: unsupported`, and `done`.
"""

import sys
import time

from tallyd_client import (
    BatchesUnsupported,
    BatchTooLarge,
    Client,
    Committed,
    ConnectionLost,
    Duplicate,
    Refused,
)


def say(line):
    print(line, flush=True)


def kill(wait=True):
    say("kill")
    if wait:
        expect_killed()


def expect_killed():
    answer = sys.stdin.readline().strip()
    assert answer == "killed", answer


def counts(tally):
    return (tally.accepted, tally.rejected)


def main(socket_path, tag, n):
    k = lambda s: f"{tag}-{s}"  # noqa: E731
    c = Client(socket_path)

    def send(counter, key, value=None, at=None, times=1):
        for _ in range(times):
            c.send(counter, key, value, at=at)

    # 1. kinds
    send("downloads", k("file"), times=10)
    send("downloads", k("file"), 5, at=1700000000000)
    send("downloads", k("file"), -2)
    send("views", str(n), 3, times=7)
    for i in range(5):
        send("uniq", k("page"), f"visitor-{i}", times=2)
    for v in (5, 42, 17):
        send("peak", k("k"), v)
    for v in (5, -3, 17):
        send("low", k("k"), v)
    for v, at in ((1, 1000), (9, 3000), (4, 2000)):
        send("latest", k("k"), v, at=at)
    send("nope", k("x"))
    send("peak", k("k"), "abc")
    send("downloads", "k" * 300)
    t = c.flush()
    assert counts(t) == (38, 3), t
    reasons = [(r.line, r.reason) for r in t.rejections]
    assert reasons == [(40, "unknown_counter"), (41, "bad_value"), (42, "key_too_long")], reasons
    assert t.rejections[0].excerpt == f"nope {tag}-x", t.rejections[0]

    # 2. corrections
    send("downloads", k("fixed"), times=3)
    c.set("downloads", k("fixed"), 100)
    send("downloads", k("fixed"), times=2)
    send("downloads", k("gone"), times=4)
    c.forget("downloads", k("gone"))
    send("downloads", k("gone2"))
    c.forget_everywhere(k("gone2"))
    try:
        c.set("uniq", k("page"), 5)
        raise AssertionError("set of a unique counter was not refused")
    except Refused as e:
        assert e.reason == "not_settable", e
    assert counts(c.flush()) == (10, 1)

    # 3. kill while lines are buffered
    send("downloads", k("a"), times=20)
    c.sync()
    send("downloads", k("b"), times=30)
    assert c.buffered_bytes > 0, "the lines wait in the client"
    kill()
    try:
        c.flush()
        raise AssertionError("flush after SIGKILL succeeded")
    except ConnectionLost as e:
        assert e.unacknowledged == 30, e
    send("downloads", k("b"), times=30)
    assert counts(c.flush()) == (30, 0)

    # 4. kill while quiet
    kill()
    send("downloads", k("c"), times=5)
    assert counts(c.flush()) == (5, 0)

    # 5. idle
    time.sleep(2.5)
    send("downloads", k("idle"), times=3)
    assert counts(c.flush()) == (3, 0)

    # 6. batches
    try:
        c.batch(f"{tag}:probe").abort()
    except BatchesUnsupported:
        say("batches: unsupported")
        return

    def log():
        with c.batch(f"{tag}:log:0") as b:
            for _ in range(20):
                b.add("downloads", k("batch"))
            b.add("nope", k("x"))
        return b.outcome

    first = log()
    assert isinstance(first, Committed) and counts(first) == (20, 1), first
    assert [(r.line, r.reason) for r in first.rejections] == [(21, "unknown_counter")], first
    assert isinstance(log(), Duplicate)
    b = c.batch(f"{tag}:aborted")
    for _ in range(7):
        b.add("downloads", k("aborted"))
    b.abort()
    try:
        with c.batch(f"{tag}:aborted") as b:
            b.add("downloads", k("aborted"))
            raise KeyError("the block fails")
    except KeyError:
        pass
    small = Client(socket_path, max_batch_bytes=100)
    b = small.batch(f"{tag}:small")
    b.add("downloads", "x" * 60)
    try:
        b.add("downloads", "x" * 60)
        raise AssertionError("a line past max_batch_bytes was added")
    except BatchTooLarge as e:
        assert e.limit == 100, e
    b.abort()
    small.close()
    with c.batch(f"{tag}:kill:0") as b:
        for i in range(2000):
            if i == 1000:
                kill(wait=False)
            b.add("downloads", k("killed-batch"))
    assert isinstance(b.outcome, Duplicate) or counts(b.outcome) == (2000, 0), b.outcome
    expect_killed()
    say("batches: ran")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    say("done")
