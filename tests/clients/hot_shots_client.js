// Drives tallyd's statsd sockets with the unmodified hot-shots client.
// usage: node hot_shots_client.js udp HOST PORT N R | uds PATH N R
// Math.random is pinned to 0 so that every sampled call is sent (hot-shots drops a sampled call
// at random before sending it); the library itself is unchanged.
const StatsD = require('hot-shots');

Math.random = () => 0;

const [mode, ...args] = process.argv.slice(2);
let client, name, n, r;
const errorHandler = (err) => {
  console.error(`hot-shots error: ${err}`);
  process.exitCode = 1;
};
if (mode === 'udp') {
  [n, r] = [Number(args[2]), Number(args[3])];
  name = 'hs_udp';
  client = new StatsD({ host: args[0], port: Number(args[1]), protocol: 'udp', maxBufferSize: 0, errorHandler });
} else if (mode === 'uds') {
  [n, r] = [Number(args[1]), Number(args[2])];
  name = 'hs_uds';
  // Buffered: unix-dgram is non-blocking and drops a datagram ("congestion") when the
  // receiver's queue is full, so fewer, fuller datagrams, and a pause now and then (below).
  client = new StatsD({ path: args[0], protocol: 'uds', maxBufferSize: 8192, bufferFlushInterval: 5, errorHandler });
} else {
  console.error(`unknown mode ${mode}`);
  process.exit(2);
}

const pause = () => new Promise((resolve) => setTimeout(resolve, 10));

async function main() {
for (let i = 0; i < n; i++) {
  client.increment('page.views', [`page:${name}`]);
  client.increment('page.views', 3, [`page:${name}`, 'env:test']);
  client.increment('logins.42');
  if (i % 100 === 99) await pause();
}
for (let i = 0; i < r; i++) {
  client.increment('scaled.hits', 1, 0.5, [`k:${name}`]);
  client.increment('page.views', 1, 0.5, [`page:${name}`]); // sampled
  client.increment('nope.metric', [`page:${name}`]); // unmapped_metric
  client.gauge('page.views', 5, [`page:${name}`]); // wrong_kind (a sum counter)
  client.histogram('page.views', 5, [`page:${name}`]); // unsupported_type
  client.distribution('page.views', 5, [`page:${name}`]); // unsupported_type
  client.timing('page.views', 5, [`page:${name}`]); // unsupported_type
  client.set('page.views', 5, [`page:${name}`]); // wrong_kind (a sum counter)
  client.gauge(`gauge.${name}`, i); // the last counter `gauges`: the last is r - 1
  client.set(`set.${name}`, 'alice'); // the unique counter `sets`: 2 values
  client.set(`set.${name}`, 'bob');
  client.event('deploy', 'text', {}, [`page:${name}`]); // ignored: event
  client.check('db.up', client.CHECKS.OK, {}, [`page:${name}`]); // ignored: service_check
}
await pause();
client.close((err) => {
  if (err) errorHandler(err);
});
}

main();
