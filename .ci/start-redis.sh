#!/usr/bin/env bash
# Install Debian's redis-server if missing, start it daemonized on 127.0.0.1:${REDIS_PORT:-6379},
# and wait until it answers PING. Used by .ci/run before the tests.
set -euo pipefail

port="${REDIS_PORT:-6379}"

if ! command -v redis-server >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends redis-server
fi

if redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG; then
    echo "redis-server already answering on 127.0.0.1:$port"
    exit 0
fi

redis-server --bind 127.0.0.1 --port "$port" --daemonize yes --save "" --appendonly no \
    --maxmemory 512mb --maxmemory-policy allkeys-lru \
    --dir "${TMPDIR:-/tmp}" --logfile "${TMPDIR:-/tmp}/redis-$port.log"

for _ in $(seq 1 100); do
    if redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG; then
        echo "redis-server ready on 127.0.0.1:$port"
        exit 0
    fi
    sleep 0.1
done
echo "redis-server did not answer on 127.0.0.1:$port" >&2
cat "${TMPDIR:-/tmp}/redis-$port.log" >&2 || true
exit 1
