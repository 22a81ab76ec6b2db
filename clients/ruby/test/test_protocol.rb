# frozen_string_literal: true

# Tallyd::Client's protocol without a daemon: the lines written, the replies parsed, and one
# connection's bookkeeping. The daemon-driven tests are conformance.rb (run by the
# repository's tests/client_libraries.rs).

require "minitest/autorun"
require "tallyd/client"

class TestProtocol < Minitest::Test
  P = Tallyd::Client::Protocol

  def test_lines_of_every_kind
    assert_equal "d k\n", P.event_line("d", "k")
    assert_equal "d k 5 @7\n", P.event_line("d", "k", 5, 7)
    assert_equal "u k @anna\n", P.event_line("u", "k", "@anna")
    assert_equal "!set d k -4 @9\n", P.set_line("d", "k", -4, 9)
    assert_equal "!forget * k\n", P.forget_line(nil, "k")
    assert_equal "!batch importer:a.log:0\n", P.batch_line("importer:a.log:0")
  end

  def test_refuses_what_would_change_the_line
    [["d", "a b"], ["d", ""], ["d", "a\nb"], ["!flush", "k"], ["d", "k", "x\ty"], ["d", "k", 1.5]].each do |args|
      assert_raises(Tallyd::Client::InvalidArgument, args.inspect) { P.event_line(*args) }
    end
    ["", "x" * 257, "a\u00a0b", "a b"].each do |id|
      assert_raises(Tallyd::Client::InvalidArgument) { P.batch_line(id) }
    end
    assert_raises(Tallyd::Client::InvalidArgument) { P.raw_line("!flush") }
  end

  def test_every_reply
    assert_equal :ok, P.parse_reply("ok").kind
    r = P.parse_reply("ok 3 1")
    assert_equal [:counts, 3, 1], [r.kind, r.accepted, r.rejected]
    r = P.parse_reply('rejected 3 unknown_counter "nope \"k\""')
    assert_equal [3, "unknown_counter", 'nope \"k\"'], r.rejection.to_a
    assert_nil P.parse_reply('rejected - overflow ""').rejection.line
    assert_equal "aa", P.parse_reply('rejected 9 too_many_fields "aa"...').rejection.excerpt
    r = P.parse_reply("error not_settable this counter's total cannot be set")
    assert_equal [:error, "not_settable"], [r.kind, r.reason]
    r = P.parse_reply("error journal write failed: No space left on device")
    assert_equal ["journal_write_failed", "No space left on device"], [r.reason, r.message]
    ["error idle for listen.idle_timeout_ms; closing", "error too many connections"].each do |closing|
      assert_equal :closing, P.parse_reply(closing).kind
    end
    ["ok x 1", "okay", "rejected 1 r noquote"].each { |bad| assert_nil P.parse_reply(bad), bad }
  end

  def test_flush_takes_its_rejections_and_acknowledges
    s = Tallyd::Client::Session.new(10)
    s.control("!errors")
    s.events(3, true)
    flush = s.control("!flush")
    s.events(2, true)
    s.received(%(ok\nrejected 3 unknown_counter "nope k"\nok 2 1\n))
    assert_equal [3], s.take(flush).rejections.map(&:line)
    assert_equal 2, s.unacknowledged
  end

  def test_unknown_control_line_is_answered_by_its_rejection
    s = Tallyd::Client::Session.new(10)
    s.control("!errors")
    batch = s.control("!batch")
    s.received(%(ok\nrejected 2 unknown_command "!batch x"\n))
    assert_equal "unknown_command", s.take(batch).reply.rejection.reason
  end

  def test_commit_takes_only_its_batch_rejections
    s = Tallyd::Client::Session.new(10)
    s.control("!errors")
    s.events(1, true)
    s.control("!batch")
    s.events(2, false)
    commit = s.control("!commit")
    s.received(%(ok\nrejected 2 bad_key "a"\nok\nrejected 5 bad_value "b"\nok 1 1\n))
    assert_equal [5], s.take(commit).rejections.map(&:line)
    assert_equal [2], s.rejections.map(&:line)
  end

  def test_a_reply_nobody_awaits_is_a_protocol_error
    assert_raises(Tallyd::Client::ProtocolError) { Tallyd::Client::Session.new(10).received("pong\n") }
  end
end
