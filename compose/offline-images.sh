#!/usr/bin/env bash
# Build the cluster's base image and a Redis image from Debian packages, for
# hosts that reach a Debian mirror but no container registry.
#
#   compose/offline-images.sh [--mirror URL] [--suite bookworm]
#                             [--base NAME] [--redis NAME]
#
# One minimal Debian root file system (debootstrap --variant=minbase) becomes
# two images:
#
#   base   (docker import) python3 with venv, iproute2 (tc), procps,
#          ca-certificates: compose/Dockerfile's BASE_IMAGE in place of
#          python:3.11-slim
#   redis  the same files run as Debian's redis-server (user redis, in /data):
#          a stand-in for the official redis image (REDIS_IMAGE)
#
# Then build and start the cluster with them:
#
#   export DDILOCO_BASE_IMAGE=ddiloco-base:bookworm DDILOCO_REDIS_IMAGE=ddiloco-redis:bookworm
#   docker-compose -f compose/compose.yaml up -d --build
#
# The mirror defaults to the first Debian mirror in this host's apt sources.
# Needs root (debootstrap), debootstrap and a running Docker engine.
set -euo pipefail

suite=bookworm
base=${DDILOCO_BASE_IMAGE:-ddiloco-base:bookworm}
redis=${DDILOCO_REDIS_IMAGE:-ddiloco-redis:bookworm}
mirror=""
while [ $# -gt 0 ]; do
    case "$1" in
        --mirror) mirror=$2; shift 2 ;;
        --suite) suite=$2; shift 2 ;;
        --base) base=$2; shift 2 ;;
        --redis) redis=$2; shift 2 ;;
        -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

if [ "$(id -u)" != 0 ]; then
    echo "debootstrap needs root: run this script as root" >&2
    exit 2
fi
for tool in debootstrap docker; do
    if ! command -v "$tool" >/dev/null; then
        echo "$tool is missing: apt-get install -y ${tool/docker/docker.io}" >&2
        exit 2
    fi
done

if [ -z "$mirror" ]; then
    # deb822 sources (URIs: ...) first, then one-line sources (deb URL suite ...).
    mirror=$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p' \
        /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -n 1 || true)
    if [ -z "$mirror" ]; then
        mirror=$(awk '$1 == "deb" && $2 !~ /security/ {print $2; exit}' \
            /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
    fi
fi
if [ -z "$mirror" ]; then
    echo "no Debian mirror found in the apt sources: give --mirror URL" >&2
    exit 2
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
started=$(date +%s)

# One debootstrap serves both images; `docker import` keeps owners and modes.
debootstrap --variant=minbase \
    --include=python3,python3-venv,iproute2,procps,ca-certificates,passwd,redis-server \
    "$suite" "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 20 "$work/debootstrap.log" >&2; exit 1; }
# What a running container never needs: package caches and lists.
rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
mkdir -p "$work/rootfs/data"
chroot "$work/rootfs" chown redis:redis /data

tar -C "$work/rootfs" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$base" >/dev/null
# Only metadata on top of the base, so no second copy of the files.
printf '%s\n' "FROM $base" "USER redis" "WORKDIR /data" "VOLUME /data" "EXPOSE 6379" \
    'CMD ["redis-server", "--protected-mode", "no"]' | docker build -q -t "$redis" - >/dev/null

echo "built $base and $redis from $mirror ($suite) in $(($(date +%s) - started)) s"
