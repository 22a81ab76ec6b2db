# frozen_string_literal: true

require_relative "lib/tallyd/client/version"

Gem::Specification.new do |spec|
  spec.name = "tallyd-client"
  spec.version = Tallyd::Client::VERSION
  spec.summary = "A client for tallyd's line protocol: events, flushes, corrections and exactly-once batches."
  spec.description = "Sends counter events to tallyd over its Unix stream socket: every counter kind, " \
                     "flush, sync, ping, corrections, and batches counted exactly once through " \
                     "reconnects, with back-pressure and rejections reported with their reasons. " \
                     "Standard library only."
  spec.authors = ["tallyd contributors"]
  spec.licenses = ["MIT", "Apache-2.0"]
  spec.required_ruby_version = ">= 2.7"
  spec.files = Dir["lib/**/*.rb"] + ["README.md", "tallyd-client.gemspec"]
  spec.require_paths = ["lib"]
end
