#!/usr/bin/env bash
# What the turn journal costs: N demo turns (TOKENS events each, over SESSIONS sessions)
# against one real sidecar and demo agent on loopback; prints the growth of agent_turns
# and agent_turn_events (pg_total_relation_size: heap, TOAST, indexes), rows, commits
# and the sidecar's journal metrics. Needs the debug binaries and a database:
#   cargo build -p leasehold-sidecar -p leasehold-demo-agent
#   N=1000 TOKENS=5 scripts/with-postgres.sh scripts/journal-cost.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
case $target in /*) ;; *) target=$root/$target ;; esac
B=${LEASEHOLD_BIN_DIR:-$target/debug}
tmp=$(mktemp -d)
IP=127.0.0.77
N=${N:-1000}
TOKENS=${TOKENS:-5}
SESSIONS=${SESSIONS:-10}
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
$B/leasehold-demo-agent --listen $IP:3000 --sidecar-url http://$IP:8082 >"$tmp/agent.log" 2>&1 & pids+=($!)
$B/leasehold-sidecar --database-url "$DATABASE_URL" --node-id m0 --insecure-peer \
  --public-listen $IP:8080 --peer-listen $IP:8081 --agent-listen $IP:8082 --admin-listen $IP:9090 \
  --advertise-peer-addr $IP:8081 --agent-url http://$IP:3000 >"$tmp/sidecar.log" 2>&1 & pids+=($!)
for i in $(seq 100); do curl -sf http://$IP:9090/readyz >/dev/null && break; sleep 0.2; done
q() { psql "$DATABASE_URL" -At -c "$1"; }
snap() {
  q "SELECT pg_total_relation_size('agent_turns'), pg_total_relation_size('agent_turn_events'),
            (SELECT count(*) FROM agent_turns), (SELECT count(*) FROM agent_turn_events),
            (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database())"
}
body="{\"text\":\"a user message of about sixty bytes, like a short question\",\"tokens\":$TOKENS}"
echo "body: ${#body} bytes; $N turns over $SESSIONS sessions, $TOKENS tokens each"
# One warm-up turn per session (its claim), then the measured turns; the 12 s pauses
# let Postgres flush its statistics (commit counts).
for s in $(seq $SESSIONS); do curl -sf -X POST http://$IP:8080/v1/sessions/m$s/turns -H 'content-type: application/json' -d "$body" >/dev/null; done
sleep 12
before=$(snap)
start=$(date +%s.%N)
for i in $(seq $N); do
  curl -sf -X POST http://$IP:8080/v1/sessions/m$(( i % SESSIONS + 1 ))/turns -H 'content-type: application/json' \
    -H "Idempotency-Key: k$TOKENS-$i" -d "$body" -o "$tmp/answer.json"
done
end=$(date +%s.%N)
echo "answer example: $(cat "$tmp/answer.json") ($(wc -c <"$tmp/answer.json") bytes)"
q "VACUUM ANALYZE agent_turns" >/dev/null; q "VACUUM ANALYZE agent_turn_events" >/dev/null
sleep 12
after=$(snap)
echo "before: $before"
echo "after:  $after"
python3 - "$before" "$after" "$N" "$start" "$end" <<'PY'
import sys
b=[int(x) for x in sys.argv[1].split('|')]; a=[int(x) for x in sys.argv[2].split('|')]; n=int(sys.argv[3])
t0,t1=float(sys.argv[4]),float(sys.argv[5])
print(f"turns rows +{a[2]-b[2]}, events rows +{a[3]-b[3]} ({(a[3]-b[3])/n:.1f}/turn)")
print(f"agent_turns +{a[0]-b[0]} B = {(a[0]-b[0])/n:.0f} B/turn; agent_turn_events +{a[1]-b[1]} B = {(a[1]-b[1])/n:.0f} B/turn, {(a[1]-b[1])/max(1,a[3]-b[3]):.0f} B/event")
print(f"total {(a[0]-b[0]+a[1]-b[1])/n:.0f} B/turn; commits +{a[4]-b[4]} = {(a[4]-b[4])/n:.2f}/turn (heartbeats included); {n/(t1-t0):.0f} turns/s sequential via curl")
PY
curl -s http://$IP:9090/metrics | grep -E "^leasehold_(journal|turn_journal)" || true
q "SELECT avg(pg_column_size(t.*))::int, avg(length(request))::int, avg(length(answer))::int FROM agent_turns t"
q "SELECT avg(pg_column_size(e.*))::int, avg(length(data))::int FROM agent_turn_events e"
