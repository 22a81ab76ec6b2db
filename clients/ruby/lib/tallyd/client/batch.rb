# frozen_string_literal: true

module Tallyd
  class Client
    # An open batch (from Client#batch): lines added are sent at once and kept until +commit+
    # is answered, so that a lost connection sends them again, under the same id, on the next
    # one. Not committed, it counts none of its lines.
    class Batch
      attr_reader :id, :outcome

      def initialize(client, id)
        @client = client
        @id = id
        @outcome = nil
      end

      # Adds one event (as Client#send_event); BatchTooLarge (the batch stays as it was) when
      # it would take the batch past max_batch_bytes.
      def add(counter, key, value = nil, at: nil)
        check_open
        @client.batch_add(Protocol.event_line(counter, key, value, at))
      end

      # Adds one event line given as text.
      def add_line(line)
        check_open
        @client.batch_add(Protocol.raw_line(line))
      end

      # `!commit`: Committed (accepted, rejected, rejections) or Duplicate, both meaning the
      # batch counts exactly once. A lost connection is retried (connect, `!batch` under the
      # same id, the lines, `!commit`) up to batch_attempts times; then BatchUnacknowledged,
      # and +commit+ may be called again.
      def commit
        check_open
        @outcome = @client.commit_batch
      end

      # `!abort`: nothing of the batch counts.
      def abort
        check_open
        @client.abort_batch(true)
      end

      private

      def check_open
        raise BatchOver, @id unless @client.batch_open?(@id)
      end
    end
  end
end
