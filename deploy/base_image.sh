#!/usr/bin/env bash
# Builds the CI base image without a registry: a minimal Debian bookworm (Python 3.11, venv, CA
# certificates) made with debootstrap and loaded with `docker import`. The host's extra CA
# certificates go in too: outgoing HTTPS on the CI machines is re-signed by a local CA, and pip
# inside `docker build` fails without it (elsewhere there are none to copy and nothing changes).
#
#   deploy/base_image.sh [IMAGE]   # default specdec-base:bookworm; skipped when it exists
#
# Needs a running engine (deploy/docker_engine.sh start) and DOCKER_HOST/DOCKER_CONFIG exported.
set -euo pipefail
IMAGE=${1:-specdec-base:bookworm}
DIR=${SPECDEC_DOCKER_DIR:-/tmp/specdec-docker}

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "[base_image] $IMAGE exists" >&2
  exit 0
fi
mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null \
  || awk '/^deb /{print $2; exit}' /etc/apt/sources.list)
rootfs="$DIR/rootfs"
rm -rf "$rootfs"
echo "[base_image] debootstrap bookworm from $mirror" >&2
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror" \
  >"$DIR/debootstrap.log" 2>&1 || { tail -n 20 "$DIR/debootstrap.log" >&2; exit 1; }
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
chroot "$rootfs" update-ca-certificates >/dev/null
tar -C "$rootfs" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
rm -rf "$rootfs"
echo "[base_image] built $IMAGE" >&2
