#!/usr/bin/env bash
# Make a local Debian bookworm base image for the kvfleet Dockerfile where no
# image can be pulled (run as root; needs debootstrap and a running dockerd).
#
#   e2e/docker/base.sh [TAG]          # default kvfleet-base:bookworm
#   e2e/docker/smoke.sh kvfleet-base:bookworm
#
# minbase + python3, python3-venv, python3-pip (Python 3.11). The host's extra CA
# certificates (/usr/local/share/ca-certificates) go into the image and pip is
# pointed at the system bundle, so pip inside `docker build` works behind an
# intercepting HTTPS proxy. MIRROR overrides the Debian mirror.
set -euo pipefail

tag=${1:-kvfleet-base:bookworm}
mirror=${MIRROR:-http://deb.debian.org/debian}
rootfs=$(mktemp -d /tmp/kvfleet-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,python3-pip bookworm "$rootfs" "$mirror"
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates
fi
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
       "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["/bin/bash"]' - "$tag"
docker run --rm "$tag" python3 -c 'import sys, venv; print(sys.version)'
