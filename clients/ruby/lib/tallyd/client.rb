# frozen_string_literal: true

require "socket"
require_relative "client/version"
require_relative "client/errors"
require_relative "client/protocol"
require_relative "client/batch"

module Tallyd
  # A connection to tallyd's stream socket (+listen.socket+) that connects again when it is
  # lost, sends a batch again under its id, and waits (reading replies meanwhile) while tallyd
  # applies back-pressure.
  #
  # Event lines are buffered up to +write_buffer_bytes+ and written when the buffer is full or
  # a reply is awaited. A lost connection fails the operation that saw it with ConnectionLost
  # (saying how many event lines are in doubt); the next operation connects again.
  #
  # Connecting tries every +backoff_initial+ seconds, doubling up to +backoff_max+, for up to
  # +connect_timeout+ seconds (or +connect_attempts+ attempts). +io_timeout+ (nil: wait as long
  # as tallyd takes) bounds every wait for a reply or for room to write.
  #
  #   tallyd = Tallyd::Client.new("/run/tallyd/tallyd.sock")
  #   tallyd.send_event("downloads", "report.pdf")
  #   tallyd.flush                      # => #<struct Tally accepted=1, rejected=0, ...>
  #   tallyd.batch("importer:cdn.log:0") { |b| b.add("downloads", "report.pdf") }
  #                                     # => Committed or Duplicate
  class Client
    NOSIGNAL = defined?(Socket::MSG_NOSIGNAL) ? Socket::MSG_NOSIGNAL : 0

    attr_reader :socket_path, :max_batch_bytes

    def initialize(socket_path, connect_timeout: 30.0, connect_attempts: nil, backoff_initial: 0.05,
                   backoff_max: 2.0, io_timeout: nil, write_buffer_bytes: 64 * 1024,
                   max_batch_bytes: 8 * 1024 * 1024, batch_attempts: 5, max_rejections: 1000)
      @socket_path = socket_path.to_s
      @connect_timeout, @connect_attempts = connect_timeout, connect_attempts
      @backoff_initial, @backoff_max = backoff_initial, backoff_max
      @io_timeout = io_timeout
      @write_buffer_bytes = write_buffer_bytes
      @max_batch_bytes = max_batch_bytes
      @batch_attempts = batch_attempts
      @max_rejections = max_rejections
      @sock = nil
      @out = +"".b
      @eof = false
      @session = Session.new(max_rejections)
      @batch = nil
      reconnect
    end

    # Queues one event: +value+ is a sum's delta (default 1) or a max, min or last value
    # (Integer), or a unique counter's value (String); +at+ the event time in Unix ms.
    def send_event(counter, key, value = nil, at: nil)
      line = Protocol.event_line(counter, key, value, at)
      no_batch("sending an event outside it")
      ready
      queue_events(line, 1)
    end

    # Queues one event line given as text ("downloads report.pdf 5").
    def send_line(line)
      line = Protocol.raw_line(line)
      no_batch("sending an event outside it")
      ready
      queue_events(line, 1)
    end

    # `!flush`: waits until every earlier line of this connection is committed in PostgreSQL;
    # returns a Tally of what was accepted and rejected since the previous flush.
    def flush
      answer = call("!flush", "!flush\n")
      reply = answer.reply
      raise refusal(reply, "!flush") unless reply.kind == :counts

      Tally.new(reply.accepted, reply.rejected, answer.rejections, answer.rejections_not_kept)
    end

    # `!sync`: waits until every earlier line is durable in tallyd's journal.
    def sync
      expect_ok(call("!sync", "!sync\n"), "!sync")
    end

    # `!ping`: waits until tallyd has taken every earlier line (not committed them).
    def ping
      reply = call("!ping", "!ping\n").reply
      raise refusal(reply, "!ping") unless reply.kind == :pong

      nil
    end

    # `!set`: +value+ becomes the key's total (sum) or kept value (max, min, last); answered
    # once committed. Refused (reason not_settable, ...) when it cannot apply.
    def set(counter, key, value, at: nil)
      expect_ok(call("a correction", Protocol.set_line(counter, key, value, at)), "a correction")
    end

    # `!forget <counter> <key>`: every row of the key deleted, once committed.
    def forget(counter, key)
      expect_ok(call("a correction", Protocol.forget_line(counter, key)), "a correction")
    end

    # `!forget * <key>`: the key forgotten in every counter whose key type takes it.
    def forget_everywhere(key)
      expect_ok(call("a correction", Protocol.forget_line(nil, key)), "a correction")
    end

    # Opens a batch under +id+ (1 to 256 bytes of text, no whitespace); its events count
    # whole, exactly once, when +commit+ returns, however often it is sent. With a block:
    # yields the batch, commits it at the end and returns the outcome (Committed or
    # Duplicate); aborts it if the block raises. Raises BatchesUnsupported when tallyd
    # predates batches.
    def batch(id)
      Protocol.batch_line(id)
      no_batch("opening another")
      @batch = BatchState.new(id)
      attempts = 0
      begin
        attempts += 1
        open_batch
      rescue ConnectionLost
        retry if attempts < @batch_attempts
        @batch = nil
        raise
      rescue Exception # rubocop:disable Lint/RescueException
        @batch = nil
        raise
      end
      handle = Batch.new(self, id)
      return handle unless block_given?

      begin
        yield handle
      rescue Exception # rubocop:disable Lint/RescueException
        abort_batch(false) if @batch
        raise
      end
      handle.commit
    end

    # Event lines sent outside batches since the last acknowledgement (flush, sync, a
    # correction): those a lost connection leaves in doubt.
    def unacknowledged
      @session.unacknowledged
    end

    # Bytes queued and not yet written to the socket.
    def buffered_bytes
      @out.bytesize
    end

    # Closes the connection (an open batch counts none of its lines).
    def close
      @sock&.close
      @sock = nil
    end

    # ---- used by Batch -----------------------------------------------------------------

    # @api private
    def batch_open?(id)
      !@batch.nil? && @batch.id == id
    end

    # @api private
    def batch_add(line)
      b = @batch
      raise BatchTooLarge.new(b.id, @max_batch_bytes) if b.lines.bytesize + line.bytesize > @max_batch_bytes

      b.lines << line
      b.count += 1
      return unless b.open_here

      begin
        queue_events(line, 1, false)
      rescue ConnectionLost
        nil # the commit sends the batch again on a new connection
      end
    end

    # @api private
    def commit_batch
      attempts = 0
      begin
        attempts += 1
        open_batch unless @batch.open_here
        answer = answer(queue("!commit", "!commit\n"))
      rescue ConnectionLost, ConnectError => e
        retry if attempts < @batch_attempts
        raise BatchUnacknowledged.new(@batch.id, attempts, e)
      rescue Exception # rubocop:disable Lint/RescueException
        @batch = nil
        raise
      end
      id = @batch.id
      batch_line = @session.batch_line
      @batch = nil
      reply = answer.reply
      return Duplicate.new(id) if reply.kind == :duplicate
      raise refusal(reply, "!commit") unless reply.kind == :counts

      answer.rejections.each { |r| r.line -= batch_line unless r.line.nil? }
      Committed.new(reply.accepted, reply.rejected, answer.rejections, answer.rejections_not_kept)
    end

    # @api private
    def abort_batch(wait)
      b = @batch
      @batch = nil
      return if b.nil? || !b.open_here

      ticket = queue("!abort", "!abort\n", wait)
      return unless wait

      begin
        expect_ok(answer(ticket), "!abort")
      rescue ConnectionLost
        nil # a connection that ends before `!commit` counts none of the batch
      end
    end

    private

    # The open batch's lines, kept until `!commit` is answered.
    BatchState = Struct.new(:id, :lines, :count, :open_here) do
      def initialize(id)
        super(id, +"".b, 0, false)
      end
    end

    def queue_events(line, count, counted = true)
      @out << line.b
      @session.events(count, counted)
      drain_if_full
    end

    def queue(what, line, keep = true)
      @out << line.b
      @session.control(what, keep)
    end

    def no_batch(doing)
      raise BatchOpen.new(@batch.id, doing) if @batch
    end

    def call(what, line)
      no_batch(what)
      ready
      answer(queue(what, line))
    end

    def answer(ticket)
      pump { @session.answered?(ticket) }
      @session.take(ticket)
    end

    def expect_ok(answer, what)
      raise refusal(answer.reply, what) unless answer.reply.kind == :ok

      nil
    end

    def refusal(reply, what)
      if what == "!batch" && %i[rejected error].include?(reply.kind)
        reason = reply.kind == :rejected ? reply.rejection.reason : reply.reason
        return BatchesUnsupported.new if reason == "unknown_command"
      end
      case reply.kind
      when :error then Refused.new(what, reply.reason, reply.message)
      when :rejected
        Refused.new(what, reply.rejection.reason, "tallyd rejected the line \"#{reply.rejection.excerpt}\"")
      else ProtocolError.new(what, reply.to_a.inspect)
      end
    end

    def open_batch
      ready
      answer = answer(queue("!batch", Protocol.batch_line(@batch.id)))
      raise refusal(answer.reply, "!batch") unless answer.reply.kind == :ok

      @batch.open_here = true
      queue_events(@batch.lines, @batch.count, false)
    end

    # Connects again after a lost connection; before the first line after a quiet spell,
    # checks that tallyd has not closed this one meanwhile (an idle timeout, a restart), so
    # that nothing is written into a closed connection.
    def ready
      if @sock && @session.quiet? && @out.empty?
        peeked = begin
          @sock.recv_nonblock(1, Socket::MSG_PEEK, exception: false)
        rescue SystemCallError
          nil
        end
        # Data or the end of the stream: either is the line tallyd sends before closing.
        drop unless peeked == :wait_readable
      end
      reconnect if @sock.nil?
    end

    def reconnect
      started = now
      attempts = 0
      loop do
        attempts += 1
        begin
          connect_once
          return
        rescue ConnectionLost, SystemCallError => e
          last = e.is_a?(ConnectionLost) ? e.cause_text : e.message
          drop
        end
        delay = [@backoff_initial * (2**[attempts - 1, 16].min), @backoff_max].min
        out_of_attempts = !@connect_attempts.nil? && attempts >= @connect_attempts
        if out_of_attempts || now - started + delay > @connect_timeout
          raise ConnectError.new(@socket_path, attempts, now - started, last)
        end

        sleep(delay)
      end
    end

    def connect_once
      sock = UNIXSocket.new(@socket_path)
      @sock, @out, @eof = sock, +"".b, false
      @session = Session.new(@max_rejections)
      @batch.open_here = false if @batch
      # Every rejected line is answered with its reason from now on.
      expect_ok(answer(queue("!errors", "!errors\n")), "!errors")
    end

    # Forgets the connection; returns what was in doubt on it.
    def drop
      unacknowledged = @session.unacknowledged
      @sock&.close
      @sock, @out, @eof = nil, +"".b, false
      @session = Session.new(@max_rejections)
      @batch.open_here = false if @batch
      unacknowledged
    end

    def lost(cause)
      closing = @session.closing
      cause = "tallyd closed the connection: #{closing}" if closing
      ConnectionLost.new(drop, cause)
    end

    def drain_if_full
      pump { @out.empty? } if @out.bytesize >= @write_buffer_bytes
    end

    # Writes and reads until the block is true; a failure drops the connection.
    def pump(&done)
      until done.call
        raise lost("tallyd closed the connection") if @eof || @sock.nil?

        writers = @out.empty? ? nil : [@sock]
        raise lost("no progress within #{@io_timeout}s (io_timeout)") unless IO.select([@sock], writers, nil, @io_timeout)

        read_available
        write_available unless @out.empty? || @eof
      end
    rescue ProtocolError
      drop
      raise
    end

    def read_available
      loop do
        data = @sock.read_nonblock(65_536, exception: false)
        return if data == :wait_readable

        if data.nil?
          @eof = true
          return
        end
        @session.received(data)
      end
    rescue SystemCallError, IOError => e
      raise lost("read: #{e.message}")
    end

    def write_available
      until @out.empty?
        n = @sock.sendmsg_nonblock(@out, NOSIGNAL, exception: false)
        return if n == :wait_writable

        @out = @out.byteslice(n..)
      end
    rescue SystemCallError, IOError => e
      raise lost("write: #{e.message}")
    end

    def now
      Process.clock_gettime(Process::CLOCK_MONOTONIC)
    end
  end
end
