#!/bin/sh
# What kind's images/base/Dockerfile does after its package installs (run inside the image
# build, with kind's images/base/files at /files and the patched entrypoint at /entrypoint),
# with Debian's containerd, runc and CNI plugins in the places kind expects its own builds.
set -e
cd /
mkdir -p /kind /LICENSES /etc/containerd /etc/systemd/system/kubelet.service.d \
  /etc/kubernetes/manifests /opt/cni/bin
cp -r /files/kind/. /kind/ && chmod 0755 /kind/bin/*
install -m0755 /files/usr/local/bin/clean-install /usr/local/bin/
install -m0755 /entrypoint /usr/local/bin/entrypoint
cp /files/LICENSES/* /LICENSES/
install -m0644 /files/etc/crictl.yaml /etc/
install -m0644 /files/etc/containerd/config.toml /etc/containerd/
install -m0644 /files/etc/default/kubelet /etc/default/
install -m0644 /files/etc/sysctl.d/* /etc/sysctl.d/
install -m0644 /files/etc/systemd/system/*.service /files/etc/systemd/system/*.slice /etc/systemd/system/
install -m0644 /files/etc/systemd/system/kubelet.service.d/* /etc/systemd/system/kubelet.service.d/
find /lib/systemd/system/sysinit.target.wants/ -name systemd-tmpfiles-setup.service -delete
rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \
  /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \
  /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/*
echo ReadKMsg=no >> /etc/systemd/journald.conf
ln -sf /lib/systemd/systemd /sbin/init
ln -sf /usr/bin/containerd /usr/local/bin/containerd
for p in /usr/lib/cni/*; do ln -sf "$p" /opt/cni/bin/; done
systemctl enable kubelet.service containerd.service undo-mount-hacks.service
systemctl mask systemd-binfmt.service
ctr oci spec \
  | jq '.hooks.createContainer[.hooks.createContainer | length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \
  | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json
rm -rf /files /entrypoint
: > /etc/machine-id
