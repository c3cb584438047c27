
# kvfleet: the node may run without --privileged (e2e/kind/shim/docker), so Docker mounted
# /sys/fs/cgroup and every cgroup v1 hierarchy read-only; --privileged would have mounted
# them read-write. Remount them here, before fix_cgroup, so systemd, this entrypoint and the
# kubelet can create cgroups. Without CAP_SYS_RESOURCE no process in the node may lower its
# oom_score_adj below the inherited floor (the kubelet asks -997 for critical static pods):
# containerd clamps it instead, as in rootless mode. A privileged node is left as it is.
kvfleet_unprivileged_node() {
  # any cgroup mount read-only (cgroup v1: the hierarchies; v2: /sys/fs/cgroup itself)?
  if ! findmnt -rn -o TARGET,OPTIONS | awk '$1 ~ "^/sys/fs/cgroup" && $2 ~ /(^|,)ro(,|$)/ { f = 1 } END { exit !f }'; then
    return 0
  fi
  log_info 'kvfleet: unprivileged node: cgroups read-write, containerd restrict_oom_score_adj'
  sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' /etc/containerd/config.toml
  mount -o remount,rw /sys/fs/cgroup || log_warn 'kvfleet: remount rw /sys/fs/cgroup failed'
  if [[ ! -f /sys/fs/cgroup/cgroup.controllers ]]; then
    local m
    for m in $(findmnt -lun -o target -t cgroup); do
      mount -o remount,rw "$m" 2>/dev/null || mount -o remount,bind,rw "$m" \
        || log_warn "kvfleet: remount rw $m failed"
    done
  fi
  [[ -e /dev/kmsg ]] || ln -s /dev/console /dev/kmsg
}
kvfleet_unprivileged_node

