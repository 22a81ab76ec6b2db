"""tallyd_client's protocol module without a daemon: the lines written, the replies parsed,
and one connection's bookkeeping. The daemon-driven tests are conformance.py (run by the
repository's tests/client_libraries.rs)."""

import unittest

from tallyd_client import InvalidArgument, ProtocolError
from tallyd_client.protocol import (
    Session,
    batch_line,
    event_line,
    forget_line,
    parse_reply,
    raw_line,
    set_line,
)


class Lines(unittest.TestCase):
    def test_every_kind(self):
        self.assertEqual(event_line("d", "k"), "d k\n")
        self.assertEqual(event_line("d", "k", 5, at=7), "d k 5 @7\n")
        self.assertEqual(event_line("u", "k", "@anna"), "u k @anna\n")
        self.assertEqual(event_line("m", "k", -3, at=1), "m k -3 @1\n")
        self.assertEqual(set_line("d", "k", -4, at=9), "!set d k -4 @9\n")
        self.assertEqual(forget_line(None, "k"), "!forget * k\n")
        self.assertEqual(batch_line("importer:a.log:0"), "!batch importer:a.log:0\n")

    def test_refuses_what_would_change_the_line(self):
        for args in [("d", "a b"), ("d", ""), ("d", "a\nb"), ("!flush", "k"), ("d", "k", "x\ty")]:
            with self.assertRaises(InvalidArgument, msg=args):
                event_line(*args)
        for bad in ["", "x" * 257, "a\u00a0b", "a b"]:
            with self.assertRaises(InvalidArgument):
                batch_line(bad)
        with self.assertRaises(InvalidArgument):
            raw_line("!flush")
        with self.assertRaises(InvalidArgument):
            event_line("d", "k", True)


class Replies(unittest.TestCase):
    def test_every_reply(self):
        self.assertEqual(parse_reply("ok").kind, "ok")
        r = parse_reply("ok 3 1")
        self.assertEqual((r.kind, r.accepted, r.rejected), ("counts", 3, 1))
        r = parse_reply('rejected 3 unknown_counter "nope \\"k\\""')
        self.assertEqual((r.rejection.line, r.rejection.reason, r.rejection.excerpt), (3, "unknown_counter", 'nope \\"k\\"'))
        self.assertIsNone(parse_reply('rejected - overflow ""').rejection.line)
        self.assertEqual(parse_reply('rejected 9 too_many_fields "aa"...').rejection.excerpt, "aa")
        r = parse_reply("error not_settable this counter's total cannot be set")
        self.assertEqual((r.kind, r.reason), ("error", "not_settable"))
        r = parse_reply("error journal write failed: No space left on device")
        self.assertEqual((r.reason, r.message), ("journal_write_failed", "No space left on device"))
        for closing in ["error idle for listen.idle_timeout_ms; closing", "error too many connections"]:
            self.assertEqual(parse_reply(closing).kind, "closing")
        for bad in ["ok x 1", "okay", "rejected 1 r noquote"]:
            self.assertIsNone(parse_reply(bad), bad)


class Bookkeeping(unittest.TestCase):
    def test_flush_takes_its_rejections_and_acknowledges(self):
        s = Session(10)
        s.control("!errors")
        s.events(3, True)
        flush = s.control("!flush")
        s.events(2, True)
        s.received(b'ok\nrejected 3 unknown_counter "nope k"\nok 2 1\n')
        a = s.take(flush)
        self.assertEqual([r.line for r in a.rejections], [3])
        self.assertEqual(s.unacknowledged, 2)

    def test_unknown_control_line_is_answered_by_its_rejection(self):
        s = Session(10)
        s.control("!errors")
        batch = s.control("!batch")
        s.received(b'ok\nrejected 2 unknown_command "!batch x"\n')
        self.assertEqual(s.take(batch).reply.rejection.reason, "unknown_command")

    def test_commit_takes_only_its_batch_rejections(self):
        s = Session(10)
        s.control("!errors")
        s.events(1, True)
        s.control("!batch")
        s.events(2, False)
        commit = s.control("!commit")
        s.received(b'ok\nrejected 2 bad_key "a"\nok\nrejected 5 bad_value "b"\nok 1 1\n')
        self.assertEqual([r.line for r in s.take(commit).rejections], [5])
        self.assertEqual([r.line for r in s.rejections], [2])

    def test_a_reply_nobody_awaits_is_a_protocol_error(self):
        with self.assertRaises(ProtocolError):
            Session(10).received(b"pong\n")


if __name__ == "__main__":
    unittest.main()
