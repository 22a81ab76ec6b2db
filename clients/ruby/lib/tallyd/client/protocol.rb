# frozen_string_literal: true

require_relative "errors"

# tallyd's line protocol without I/O: the lines the client writes (checked only for what would
# change their meaning), the replies it reads, and one connection's bookkeeping (line numbers,
# control lines awaiting their replies in order, rejections, acknowledged events).
module Tallyd
  class Client
    # A rejected line as tallyd reported it after `!errors`. +line+: its number on the
    # connection (within the batch, from 1, for a batch's lines); nil for an `overflow` found
    # after the line left the connection. +excerpt+: its first 64 bytes, escaped as sent.
    Rejection = Struct.new(:line, :reason, :excerpt)

    # What tallyd counted: the answer to `!flush`.
    Tally = Struct.new(:accepted, :rejected, :rejections, :rejections_not_kept)

    # This copy of the batch was committed (durable in tallyd's journal) and counts.
    Committed = Struct.new(:accepted, :rejected, :rejections, :rejections_not_kept)

    # A copy under this id was committed before: nothing of this copy counted.
    Duplicate = Struct.new(:batch_id)

    module Protocol
      MAX_BATCH_ID_BYTES = 256

      module_function

      def field(name, value)
        value = value.to_s
        raise InvalidArgument.new(name, value, "it is empty") if value.empty?
        if value.include?(" ") || value.include?("\t")
          raise InvalidArgument.new(name, value, "it holds a space or tab, which separate fields")
        end
        raise InvalidArgument.new(name, value, "it holds a line break") if value.match?(/[\r\n]/)

        value
      end

      def counter(name)
        field("counter", name)
        if name.to_s.start_with?("!")
          raise InvalidArgument.new("counter", name, "a first field starting with `!` is a control line")
        end

        name.to_s
      end

      def at(time)
        return "" if time.nil?
        unless time.is_a?(Integer) && time >= 0
          raise InvalidArgument.new("at", time, "an event time is an Integer of milliseconds since the epoch")
        end

        " @#{time}"
      end

      # `<counter> <key> [<value>] [@<unix_ms>]\n`: value is a sum's delta or a max, min or
      # last value (Integer), or a unique counter's value (String).
      def event_line(counter_name, key, value = nil, at_ms = nil)
        line = +"#{counter(counter_name)} #{field('key', key)}"
        case value
        when nil then nil
        when Integer then line << " #{value}"
        when String then line << " #{field('value', value)}"
        else raise InvalidArgument.new("value", value, "a value is an Integer or a String")
        end
        line << at(at_ms) << "\n"
      end

      def set_line(counter_name, key, value, at_ms = nil)
        raise InvalidArgument.new("value", value, "`!set` takes an Integer") unless value.is_a?(Integer)

        "!set #{counter(counter_name)} #{field('key', key)} #{value}#{at(at_ms)}\n"
      end

      def forget_line(counter_name, key)
        "!forget #{counter_name.nil? ? '*' : counter(counter_name)} #{field('key', key)}\n"
      end

      def batch_line(id)
        raise InvalidArgument.new("batch id", id, "it is empty") if !id.is_a?(String) || id.empty?
        if id.bytesize > MAX_BATCH_ID_BYTES
          raise InvalidArgument.new("batch id", id, "it is longer than 256 bytes")
        end
        if id.match?(/[[:space:][:cntrl:]\u0085\u00a0]/)
          raise InvalidArgument.new("batch id", id, "it holds a control character or whitespace")
        end

        "!batch #{id}\n"
      end

      # A line given as text: one line, not a control line; the "\n" added when missing.
      def raw_line(line)
        body = line.end_with?("\n") ? line[0...-1] : line
        raise InvalidArgument.new("line", line, "it holds more than one line") if body.include?("\n")
        if body.sub(/\A[ \t]+/, "").start_with?("!")
          raise InvalidArgument.new("line", line, "control lines are sent by the client's own methods")
        end

        "#{body}\n"
      end

      # One parsed reply: +kind+ is :ok, :counts, :pong, :duplicate, :rejected, :error or
      # :closing.
      Reply = Struct.new(:kind, :accepted, :rejected, :rejection, :reason, :message)

      # One reply line (without its newline), or nil for a line the protocol does not have.
      def parse_reply(text)
        case text
        when "ok" then return Reply.new(:ok)
        when "pong" then return Reply.new(:pong)
        when "duplicate" then return Reply.new(:duplicate)
        when /\Aok (\d+) (\d+)\z/ then return Reply.new(:counts, Regexp.last_match(1).to_i, Regexp.last_match(2).to_i)
        when /\Arejected (-|\d+) (\S+) "(.*)"(?:\.\.\.)?\z/
          number, reason, excerpt = Regexp.last_match.captures
          line = number == "-" ? nil : number.to_i
          return Reply.new(:rejected, 0, 0, Rejection.new(line, reason, excerpt))
        end
        return nil unless text.start_with?("error ")

        rest = text[6..]
        # The lines of a closing connection, and `!sync`'s journal error, predate the
        # `error <reason> <message>` form.
        return Reply.new(:closing, 0, 0, nil, nil, rest) if rest.start_with?("idle") || rest == "too many connections"
        if rest.start_with?("journal write failed: ")
          return Reply.new(:error, 0, 0, nil, "journal_write_failed", rest.delete_prefix("journal write failed: "))
        end

        reason, message = rest.split(" ", 2)
        Reply.new(:error, 0, 0, nil, reason, message.to_s)
      end
    end

    # The control lines whose `ok` acknowledges the event lines before them.
    ACKNOWLEDGING = ["!flush", "!sync", "a correction"].freeze

    Answer = Struct.new(:reply, :rejections, :rejections_not_kept)
    Awaited = Struct.new(:ticket, :what, :line, :events_before, :keep, :batch_line)

    # The bookkeeping of one connection: fed the lines queued and the reply lines read.
    class Session
      attr_reader :closing, :batch_line, :rejections

      def initialize(max_rejections)
        @lines = 0
        @tickets = 0
        @awaited = []
        @answers = {}
        @rejections = []
        @rejections_not_kept = 0
        @max_rejections = max_rejections
        @events_sent = 0
        @acknowledged = 0
        @batch_line = 0
        @closing = nil
        @input = +""
      end

      def events(count, counted)
        @lines += count
        @events_sent += count if counted
      end

      def control(what, keep = true)
        @lines += 1
        @tickets += 1
        @batch_line = @lines if what == "!batch"
        @awaited << Awaited.new(@tickets, what, @lines, @events_sent, keep, @batch_line)
        @tickets
      end

      def unacknowledged
        @events_sent - @acknowledged
      end

      def quiet?
        @awaited.empty? && unacknowledged.zero?
      end

      # Bytes read from the socket: each complete line is taken.
      def received(data)
        @input << data
        while (i = @input.index("\n"))
          line = @input.slice!(0, i + 1).chomp("\n")
          on_line(line.force_encoding(Encoding::UTF_8).scrub)
        end
      end

      def on_line(text)
        front = @awaited.first
        reply = Protocol.parse_reply(text)
        raise ProtocolError.new(front ? front.what : "nothing", text) if reply.nil?

        case reply.kind
        when :closing then @closing = reply.message
        when :rejected
          # A control line tallyd does not know is rejected like an event line: the reply to
          # that line is its answer.
          if front && reply.rejection.line == front.line
            answer(reply)
          elsif @rejections.size < @max_rejections
            @rejections << reply.rejection
          else
            @rejections_not_kept += 1
          end
        else
          raise ProtocolError.new("nothing", text) if front.nil?

          answer(reply)
        end
      end

      def answered?(ticket)
        @answers.key?(ticket)
      end

      def take(ticket)
        @answers.delete(ticket)
      end

      private

      def answer(reply)
        a = @awaited.shift
        if %i[ok counts].include?(reply.kind) && ACKNOWLEDGING.include?(a.what)
          @acknowledged = [@acknowledged, a.events_before].max
        end
        rejections = []
        not_kept = 0
        if a.what == "!flush"
          rejections, @rejections = @rejections, []
          not_kept, @rejections_not_kept = @rejections_not_kept, 0
        elsif a.what == "!commit"
          # The batch's lines follow its `!batch` line.
          rejections, @rejections = @rejections.partition { |r| r.line.nil? || r.line > a.batch_line }
          not_kept, @rejections_not_kept = @rejections_not_kept, 0
        end
        @answers[a.ticket] = Answer.new(reply, rejections, not_kept) if a.keep
      end
    end
  end
end
