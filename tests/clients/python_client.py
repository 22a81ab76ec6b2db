"""Drives tallyd's statsd sockets with an unmodified Python statsd client library.

usage: python_client.py datadog-uds PATH N R | datadog-udp HOST PORT N R | statsd-udp HOST PORT N R

Sends a known workload (see tests/statsd.rs for what each line must become). The client's
sampling random number generator is pinned to 0 so that every sampled call is sent (the
libraries drop a sampled call at random before sending it); the library itself is unchanged.
"""
import random
import sys

random.random = lambda: 0.0


def datadog_workload(c, name, n, r):
    from datadog.dogstatsd import base
    base.random = lambda: 0.0
    for _ in range(n):
        c.increment("page.views", tags=[f"page:{name}"])
        c.increment("page.views", 3, tags=[f"page:{name}", "env:test"])
        c.increment("logins.42")
    for _ in range(r):
        c.increment("scaled.hits", tags=[f"k:{name}"], sample_rate=0.5)
        c.increment("page.views", tags=[f"page:{name}"], sample_rate=0.5)  # sampled
        c.increment("nope.metric", tags=[f"page:{name}"])  # unmapped_metric
        c.gauge("page.views", 5, tags=[f"page:{name}"])  # wrong_kind (a sum counter)
        c.histogram("page.views", 5, tags=[f"page:{name}"])  # unsupported_type
        c.distribution("page.views", 5, tags=[f"page:{name}"])  # unsupported_type
        c.timing("page.views", 5, tags=[f"page:{name}"])  # unsupported_type
        c.set("page.views", 5, tags=[f"page:{name}"])  # wrong_kind (a sum counter)
        c.gauge(f"gauge.{name}", 7)  # the last counter `gauges`
        c.set(f"set.{name}", "alice")  # the unique counter `sets`: 2 values
        c.set(f"set.{name}", "bob")
        c.event("deploy", "text", tags=[f"page:{name}"])  # ignored: event
        c.service_check("db.up", 0, tags=[f"page:{name}"])  # ignored: service_check


def statsd_workload(c, name, n, r):
    for _ in range(n):
        c.incr(f"hits.{name}")
        c.incr(f"hits.{name}", 3)
        c.incr("logins.42")
    for _ in range(r):
        c.incr(f"hits.{name}", rate=0.5)  # sampled
        c.incr("nope.metric")  # unmapped_metric
        c.gauge(f"hits.{name}", 5)  # wrong_kind (a sum counter)
        c.timing(f"hits.{name}", 5)  # unsupported_type
        c.set(f"hits.{name}", 5)  # wrong_kind (a sum counter)
        c.gauge(f"gauge.{name}", 7)  # the last counter `gauges`
        c.set(f"set.{name}", "alice")  # the unique counter `sets`: 2 values
        c.set(f"set.{name}", "bob")


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "datadog-uds":
        from datadog import DogStatsd
        path, n, r = args[0], int(args[1]), int(args[2])
        c = DogStatsd(socket_path=path, disable_telemetry=True, socket_timeout=None)
        datadog_workload(c, "dd_uds", n, r)
        c.flush()
        c.close_socket()
    elif mode == "datadog-udp":
        from datadog import DogStatsd
        host, port, n, r = args[0], int(args[1]), int(args[2]), int(args[3])
        c = DogStatsd(host=host, port=port, disable_telemetry=True)
        datadog_workload(c, "dd_udp", n, r)
        c.flush()
        c.close_socket()
    elif mode == "statsd-udp":
        import statsd
        host, port, n, r = args[0], int(args[1]), int(args[2]), int(args[3])
        c = statsd.StatsClient(host, port)
        statsd_workload(c, "py_statsd", n, r)
        c.close()
    else:
        sys.exit(f"unknown mode {mode}")


main()
