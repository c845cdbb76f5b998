#!/usr/bin/env bash
# A local Ray cluster on this machine (CPU only), started with the real `ray start --head`,
# for the quickstart and the deploy tests. Jobs go to it with the real `ray job submit`.
#
#   cluster/local-cluster.sh start     # start it (idempotent), print the env to use it
#   eval "$(cluster/local-cluster.sh env)"
#   ray job submit --working-dir . -- python -m raytrain run jobs/quickstart.yaml
#   cluster/local-cluster.sh status | stop   # stop: gone within ~3 s; `ray job stop` a running job first
#                                            # (it commits a checkpoint, then the cluster can go)
#
# Settings (environment, all optional):
#   RAYTRAIN_CLUSTER_DIR     state folder: auth token, Ray temp dir, logs (default .raytrain/cluster;
#                            keep it short, Ray's socket paths must stay under 107 characters)
#   RAYTRAIN_NUM_CPUS        logical CPUs to advertise (default: max(nproc, 4) + 2, so Ray Data
#                            gets CPUs beside the training workers, see docs on CPU-only runs)
#   RAYTRAIN_GCS_PORT (6379), RAYTRAIN_DASHBOARD_PORT (8265), RAYTRAIN_CLIENT_PORT (10001),
#   RAYTRAIN_AGENT_PORT (52365): ports, so two clusters can share one machine
#   RAYTRAIN_STOP_WAIT_S     how long `ray job stop` lets a job checkpoint before SIGKILL (120)
# Secrets (HF_TOKEN, AWS_*, MLFLOW_TRACKING_*) are taken from the environment of `start`:
# jobs inherit the head's environment; nothing is written into job files.
#
# Why not `ray stop`: it kills every Ray process of this user on the machine, other clusters
# included. This script starts the head in a session of its own and stops that process group.
set -euo pipefail

# The repository's own environment (cluster/setup-local.sh), activated or not: its `ray` and
# `python` start the cluster, and `env` puts them first on the PATH of the shell that submits.
VENV_BIN="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin"
if [ -x "$VENV_BIN/ray" ]; then
  PATH="$VENV_BIN:$PATH"
elif ! command -v ray >/dev/null 2>&1; then
  echo "ray is not installed: run 'bash cluster/setup-local.sh' first (it makes .venv)" >&2
  exit 1
fi

DIR="${RAYTRAIN_CLUSTER_DIR:-.raytrain/cluster}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
GCS_PORT="${RAYTRAIN_GCS_PORT:-6379}"
DASHBOARD_PORT="${RAYTRAIN_DASHBOARD_PORT:-8265}"
CLIENT_PORT="${RAYTRAIN_CLIENT_PORT:-10001}"
AGENT_PORT="${RAYTRAIN_AGENT_PORT:-52365}"
CORES="$(nproc)"
NUM_CPUS="${RAYTRAIN_NUM_CPUS:-$(( (CORES > 4 ? CORES : 4) + 2 ))}"

env_lines() {
  # Ray 2.60 enables token authentication: every client (ray job, ray status) needs the token.
  [ -x "$VENV_BIN/ray" ] && echo "export PATH=$VENV_BIN:\$PATH"
  echo "export RAY_AUTH_MODE=token"
  echo "export RAY_AUTH_TOKEN_PATH=$DIR/auth_token"
  echo "export RAY_API_SERVER_ADDRESS=http://127.0.0.1:$(cat "$DIR/dashboard_port" 2>/dev/null || echo "$DASHBOARD_PORT")"
}

running() {
  [[ -f "$DIR/pgid" ]] && kill -0 -- "-$(cat "$DIR/pgid")" 2>/dev/null
}

start() {
  if running; then
    echo "# already running (process group $(cat "$DIR/pgid"))" >&2
    env_lines
    return 0
  fi
  if [[ ! -s "$DIR/auth_token" ]]; then
    (umask 077 && python -c "import secrets; print(secrets.token_hex(32))" > "$DIR/auth_token")
  fi
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$DIR/auth_token"
  export RAY_JOB_STOP_WAIT_TIME_S="${RAYTRAIN_STOP_WAIT_S:-120}"
  echo "$DASHBOARD_PORT" > "$DIR/dashboard_port"
  # setsid: the head and everything it spawns share one new process group, recorded for `stop`.
  setsid ray start --head --node-ip-address 127.0.0.1 --port "$GCS_PORT" \
    --dashboard-host 127.0.0.1 --dashboard-port "$DASHBOARD_PORT" --include-dashboard true \
    --ray-client-server-port "$CLIENT_PORT" --dashboard-agent-listen-port "$AGENT_PORT" \
    --num-cpus "$NUM_CPUS" --temp-dir "$DIR/ray" --disable-usage-stats \
    </dev/null >"$DIR/start.log" 2>&1 &
  local pid=$!
  echo "$pid" > "$DIR/pgid"
  if ! wait "$pid"; then
    cat "$DIR/start.log" >&2
    echo "ray start failed; log above ($DIR/start.log)" >&2
    stop >/dev/null 2>&1 || true
    return 1
  fi
  # The job server comes up a little after `ray start` returns: wait until it answers.
  for _ in $(seq 1 60); do
    if ray job list --address "http://127.0.0.1:$DASHBOARD_PORT" >/dev/null 2>&1; then
      echo "# Ray head on 127.0.0.1 ($NUM_CPUS CPUs), dashboard http://127.0.0.1:$DASHBOARD_PORT" >&2
      env_lines
      return 0
    fi
    sleep 1
  done
  echo "the Ray job server did not answer on port $DASHBOARD_PORT; see $DIR/ray/session_latest/logs" >&2
  return 1
}

stop() {
  if ! running; then
    echo "# not running" >&2
    rm -f "$DIR/pgid"
    return 0
  fi
  local pgid
  pgid="$(cat "$DIR/pgid")"
  kill -TERM -- "-$pgid" 2>/dev/null || true
  # Most of the group exits at once; gcs_server, the raylet, the autoscaler monitor and the
  # runtime-env agent were still there 8 s after SIGTERM here (they wait on each other), so
  # they get 3 s, then SIGKILL (the group is this cluster alone: nothing else is in it).
  for _ in $(seq 1 6); do
    kill -0 -- "-$pgid" 2>/dev/null || break
    sleep 0.5
  done
  kill -KILL -- "-$pgid" 2>/dev/null || true
  rm -f "$DIR/pgid"
  echo "# stopped (process group $pgid); Ray worker processes exit when their raylet is gone" >&2
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) if running; then echo "running (process group $(cat "$DIR/pgid"))"; env_lines; else echo "not running"; exit 3; fi ;;
  env) env_lines ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
