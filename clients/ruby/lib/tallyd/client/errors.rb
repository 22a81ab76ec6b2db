# frozen_string_literal: true

# The exceptions of Tallyd::Client: each names what failed and why.
module Tallyd
  class Client
    # Every error of this library.
    class Error < StandardError; end

    # Connecting (and tallyd's first answer) failed on every attempt the backoff allowed.
    class ConnectError < Error
      attr_reader :socket_path, :attempts, :elapsed, :last

      def initialize(socket_path, attempts, elapsed, last)
        @socket_path, @attempts, @elapsed, @last = socket_path, attempts, elapsed, last
        super(format("cannot connect to tallyd at %s: %d attempts in %.1fs, the last: %s",
                     socket_path, attempts, elapsed, last))
      end
    end

    # The connection ended. +unacknowledged+ event lines sent outside a batch since the last
    # acknowledgement (flush, sync, a correction) may or may not have counted. The next
    # operation connects again; send under a batch to retry without counting twice.
    class ConnectionLost < Error
      attr_reader :unacknowledged, :cause_text

      def initialize(unacknowledged, cause_text)
        @unacknowledged, @cause_text = unacknowledged, cause_text
        super("connection to tallyd lost (#{cause_text}); #{unacknowledged} event lines sent " \
              "since the last acknowledgement may or may not have counted")
      end
    end

    # tallyd answered a control line with `error <reason> <message>` (a correction it cannot
    # apply, `!sync` after a failed journal write, a batch it refuses): nothing of it changed.
    class Refused < Error
      attr_reader :what, :reason, :detail

      def initialize(what, reason, detail)
        @what, @reason, @detail = what, reason, detail
        super("tallyd refused #{what}: #{reason}: #{detail}")
      end
    end

    # tallyd does not know `!batch` (it answered unknown_command): it predates batches.
    class BatchesUnsupported < Error
      def initialize
        super("tallyd does not support batches (it answered `!batch` with unknown_command); upgrade tallyd")
      end
    end

    # Adding the line would take the batch past max_batch_bytes: the client keeps every line
    # of a batch until it is acknowledged. The batch is still open without this line.
    class BatchTooLarge < Error
      attr_reader :batch_id, :limit

      def initialize(batch_id, limit)
        @batch_id, @limit = batch_id, limit
        super("batch #{batch_id.inspect}: adding this line would exceed max_batch_bytes " \
              "(#{limit} bytes); commit it and start another batch")
      end
    end

    # The batch was sent +attempts+ times without an answer to `!commit`: send it again under
    # the same id (it counts at most once); +commit+ may be called again.
    class BatchUnacknowledged < Error
      attr_reader :batch_id, :attempts, :last

      def initialize(batch_id, attempts, last)
        @batch_id, @attempts, @last = batch_id, attempts, last
        super("batch #{batch_id.inspect} unacknowledged after #{attempts} attempts " \
              "(the last: #{last.message}); send it again under the same id")
      end
    end

    # The batch was already committed, aborted or refused.
    class BatchOver < Error
      def initialize(batch_id)
        super("batch #{batch_id.inspect} is over (committed, aborted or refused); open a new one")
      end
    end

    # A batch is open on this client: events go into it (Batch#add), and nothing else is sent
    # until it is committed or aborted (tallyd would answer `batch_open`).
    class BatchOpen < Error
      def initialize(batch_id, doing)
        super("batch #{batch_id.inspect} is open: commit or abort it before #{doing}")
      end
    end

    # An argument refused before sending: it would change the line's meaning (a space in a key
    # splits it into two fields) or is not a line of this kind.
    class InvalidArgument < Error
      attr_reader :field, :value, :why

      def initialize(field, value, why)
        @field, @value, @why = field, value, why
        super("invalid #{field} #{value.inspect}: #{why}")
      end
    end

    # A reply the protocol does not allow here; the connection is dropped.
    class ProtocolError < Error
      def initialize(to, reply)
        super("unexpected reply from tallyd to #{to}: #{reply.inspect}")
      end
    end
  end
end
