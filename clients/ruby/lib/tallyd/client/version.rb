# frozen_string_literal: true

module Tallyd
  class Client
    VERSION = "0.1.0"
  end
end
