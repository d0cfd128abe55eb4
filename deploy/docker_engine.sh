#!/usr/bin/env bash
# A private Docker engine + compose v2 for CI on a machine that has neither (Debian bookworm, as
# root, reaching only Debian's archive and PyPI). Everything lives under $SPECDEC_DOCKER_DIR,
# dockerd's data root and socket included, so `stop` leaves the machine as it was.
#
#   deploy/docker_engine.sh start   # install (first time), start dockerd; prints the env to use
#   deploy/docker_engine.sh stop    # stop dockerd (and the containerd it started), keep the data
#   deploy/docker_engine.sh purge   # stop, then delete the data root and the docker0 bridge
#
# Callers export DOCKER_HOST and DOCKER_CONFIG as `env` prints them (the compose plugin lives
# in DOCKER_CONFIG/cli-plugins; nothing is installed outside Debian's own packages).
set -euo pipefail
DIR=${SPECDEC_DOCKER_DIR:-/tmp/specdec-docker}
export DOCKER_HOST="unix://$DIR/docker.sock" DOCKER_CONFIG="$DIR/docker-config"
export DEBIAN_FRONTEND=noninteractive

log() { echo "[docker_engine] $*" >&2; }

debian_mirror() {
  awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null \
    || awk '/^deb /{print $2; exit}' /etc/apt/sources.list
}

install_engine() {
  if command -v dockerd >/dev/null && command -v debootstrap >/dev/null && command -v iptables >/dev/null; then
    return
  fi
  log "installing docker.io, iptables, debootstrap from Debian"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends docker.io iptables debootstrap >/dev/null
}

# Compose v2 is not in bookworm; trixie's docker-compose package holds the CLI plugin (a static
# Go binary needing only libc >= 2.34). Fetch that one .deb with a private apt state and unpack it.
install_compose_plugin() {
  local plugin="$DOCKER_CONFIG/cli-plugins/docker-compose"
  [ -x "$plugin" ] && return
  log "fetching the compose v2 plugin from Debian trixie's docker-compose package"
  local apt_dir="$DIR/apt-trixie"
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs" "$(dirname "$plugin")"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $(debian_mirror) trixie main" \
    > "$apt_dir/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o APT::Sandbox::User=root)
  apt-get "${opts[@]}" update -qq
  (cd "$apt_dir/debs" && apt-get "${opts[@]}" download docker-compose >/dev/null)
  dpkg-deb -x "$apt_dir"/debs/docker-compose_*.deb "$apt_dir/unpacked"
  cp "$apt_dir/unpacked/usr/libexec/docker/cli-plugins/docker-compose" "$plugin"
  rm -rf "$apt_dir"
}

# dockerd registers the "nvidia" device driver only if this hook is on its PATH when it starts;
# compose's GPU reservations then pass and the containers start without a GPU. CI-only stand-in:
# never made where a real hook or an NVIDIA device exists.
fake_nvidia_hook_dir() {
  local bin="$DIR/fakebin"
  mkdir -p "$bin"
  if ! command -v nvidia-container-runtime-hook >/dev/null && [ ! -e /dev/nvidiactl ]; then
    printf '#!/bin/sh\n# no-op stand-in so dockerd accepts GPU reservations on a GPU-less CI host\ncat >/dev/null\nexit 0\n' \
      > "$bin/nvidia-container-runtime-hook"
    chmod +x "$bin/nvidia-container-runtime-hook"
  fi
  echo "$bin"
}

is_running() { [ -f "$DIR/dockerd.pid" ] && kill -0 "$(cat "$DIR/dockerd.pid")" 2>/dev/null; }

start() {
  mkdir -p "$DIR"
  install_engine
  install_compose_plugin
  if ! is_running; then
    log "starting dockerd (data root $DIR/data)"
    local hook_dir; hook_dir=$(fake_nvidia_hook_dir)
    PATH="$hook_dir:$PATH" setsid dockerd --host "$DOCKER_HOST" --data-root "$DIR/data" \
      --exec-root "$DIR/exec" --pidfile "$DIR/dockerd.pid.own" >"$DIR/dockerd.log" 2>&1 &
    echo $! > "$DIR/dockerd.pid"
  fi
  for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info --format 'engine {{.ServerVersion}}, storage {{.Driver}}, cgroup v{{.CgroupVersion}}' >&2 \
    || { tail -n 30 "$DIR/dockerd.log" >&2; exit 1; }
  docker compose version >&2
  env
}

stop() {
  is_running || return 0
  local pid; pid=$(cat "$DIR/dockerd.pid")
  log "stopping dockerd (pid $pid)"
  kill "$pid"
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  rm -f "$DIR/dockerd.pid"
}

env() { echo "export DOCKER_HOST=$DOCKER_HOST DOCKER_CONFIG=$DOCKER_CONFIG"; }

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  purge) stop; rm -rf "$DIR"; ip link delete docker0 2>/dev/null || true ;;   # dockerd leaves its bridge
  env) env ;;
  *) echo "usage: $0 start|stop|purge|env" >&2; exit 2 ;;
esac
