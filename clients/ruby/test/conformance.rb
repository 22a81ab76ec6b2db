# frozen_string_literal: true

# The client libraries' WORKLOAD (tests/client_libraries.rs says what it is and checks the
# totals in PostgreSQL) with Tallyd::Client, against a real tallyd.
#
#   ruby conformance.rb SOCKET TAG N
#
# Prints `kill` when the daemon is to be killed with SIGKILL (the driver answers `killed` on
# stdin, then starts it again), `batches: ran` or `batches: unsupported`, and `done`.

require "tallyd/client"

C = Tallyd::Client

def say(line)
  $stdout.puts(line)
  $stdout.flush
end

def check(ok, what)
  raise "assertion failed: #{what}" unless ok
end

def expect_killed
  answer = $stdin.gets.to_s.strip
  check(answer == "killed", "the driver answered #{answer.inspect}")
end

def kill(wait: true)
  say("kill")
  expect_killed if wait
end

def counts(tally)
  [tally.accepted, tally.rejected]
end

def workload(socket, tag, number)
  k = ->(s) { "#{tag}-#{s}" }
  c = C.new(socket)
  send = lambda do |counter, key, value = nil, at: nil, times: 1|
    times.times { c.send_event(counter, key, value, at: at) }
  end

  # 1. kinds
  send.call("downloads", k["file"], times: 10)
  send.call("downloads", k["file"], 5, at: 1_700_000_000_000)
  send.call("downloads", k["file"], -2)
  send.call("views", number.to_s, 3, times: 7)
  5.times { |i| send.call("uniq", k["page"], "visitor-#{i}", times: 2) }
  [5, 42, 17].each { |v| send.call("peak", k["k"], v) }
  [5, -3, 17].each { |v| send.call("low", k["k"], v) }
  [[1, 1000], [9, 3000], [4, 2000]].each { |v, at| send.call("latest", k["k"], v, at: at) }
  send.call("nope", k["x"])
  send.call("peak", k["k"], "abc")
  send.call("downloads", "k" * 300)
  t = c.flush
  check(counts(t) == [38, 3], "kinds flush #{t.to_a}")
  reasons = t.rejections.map { |r| [r.line, r.reason] }
  check(reasons == [[40, "unknown_counter"], [41, "bad_value"], [42, "key_too_long"]], reasons.inspect)
  check(t.rejections[0].excerpt == "nope #{tag}-x", t.rejections[0].to_a.inspect)

  # 2. corrections
  send.call("downloads", k["fixed"], times: 3)
  c.set("downloads", k["fixed"], 100)
  send.call("downloads", k["fixed"], times: 2)
  send.call("downloads", k["gone"], times: 4)
  c.forget("downloads", k["gone"])
  send.call("downloads", k["gone2"])
  c.forget_everywhere(k["gone2"])
  begin
    c.set("uniq", k["page"], 5)
    raise "set of a unique counter was not refused"
  rescue C::Refused => e
    check(e.reason == "not_settable", e.message)
  end
  check(counts(c.flush) == [10, 1], "corrections flush")

  # 3. kill while lines are buffered
  send.call("downloads", k["a"], times: 20)
  c.sync
  send.call("downloads", k["b"], times: 30)
  check(c.buffered_bytes.positive?, "the lines wait in the client")
  kill
  begin
    c.flush
    raise "flush after SIGKILL succeeded"
  rescue C::ConnectionLost => e
    check(e.unacknowledged == 30, e.message)
  end
  send.call("downloads", k["b"], times: 30)
  check(counts(c.flush) == [30, 0], "the resent lines")

  # 4. kill while quiet
  kill
  send.call("downloads", k["c"], times: 5)
  check(counts(c.flush) == [5, 0], "after a quiet kill")

  # 5. idle
  sleep(2.5)
  send.call("downloads", k["idle"], times: 3)
  check(counts(c.flush) == [3, 0], "after the idle timeout")

  # 6. batches
  begin
    c.batch("#{tag}:probe").abort
  rescue C::BatchesUnsupported
    say("batches: unsupported")
    return
  end
  log = lambda do
    c.batch("#{tag}:log:0") do |b|
      20.times { b.add("downloads", k["batch"]) }
      b.add("nope", k["x"])
    end
  end
  first = log.call
  check(first.is_a?(C::Committed) && counts(first) == [20, 1], first.inspect)
  check(first.rejections.map { |r| [r.line, r.reason] } == [[21, "unknown_counter"]], first.inspect)
  check(log.call.is_a?(C::Duplicate), "the second copy is a duplicate")
  b = c.batch("#{tag}:aborted")
  7.times { b.add("downloads", k["aborted"]) }
  b.abort
  begin
    c.batch("#{tag}:aborted") do |batch|
      batch.add("downloads", k["aborted"])
      raise KeyError, "the block fails"
    end
  rescue KeyError
    nil
  end
  small = C.new(socket, max_batch_bytes: 100)
  b = small.batch("#{tag}:small")
  b.add("downloads", "x" * 60)
  begin
    b.add("downloads", "x" * 60)
    raise "a line past max_batch_bytes was added"
  rescue C::BatchTooLarge => e
    check(e.limit == 100, e.message)
  end
  b.abort
  small.close
  outcome = c.batch("#{tag}:kill:0") do |batch|
    2000.times do |i|
      kill(wait: false) if i == 1000
      batch.add("downloads", k["killed-batch"])
    end
  end
  check(outcome.is_a?(C::Duplicate) || counts(outcome) == [2000, 0], outcome.inspect)
  expect_killed
  say("batches: ran")
end

workload(ARGV[0], ARGV[1], Integer(ARGV[2]))
say("done")
