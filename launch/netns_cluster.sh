#!/usr/bin/env bash
# Test hosts on one machine: N network namespaces (hosts a, b, c, ...) joined by a bridge,
# links optionally shaped (delay, jitter, rate), commands run inside a host, teardown.
# Root only (ip netns, veth, bridge, tun/tap, tc: iproute2). Docs: docs/multi-host.md.
#
#   launch/netns_cluster.sh up NAME [--hosts N] [--root-link] [--delay 2ms --jitter 1ms --rate 1gbit]
#                                   [--mtu 9000] [--shaper auto|netem|wire] [--shapeable]
#   launch/netns_cluster.sh exec NAME HOST -- COMMAND ...    # e.g. exec demo a -- .venv/bin/atomd serve ...
#   launch/netns_cluster.sh shape NAME HOST|all [--delay .. --jitter .. --rate ..]   # none: unshaped
#   launch/netns_cluster.sh cut NAME HOST | restore NAME HOST # unplug / replug a host's cable
#   launch/netns_cluster.sh status [NAME]
#   launch/netns_cluster.sh down NAME | down --all            # stops every process inside, deletes all
#   launch/netns_cluster.sh clean                             # what crashed test runs left behind
#
# Hosts get 10.213.S.1, .2, ... (S: a /24 nothing else on this machine uses; `status` shows
# it); --root-link gives this (root) namespace 10.213.S.254 on the bridge, so a browser,
# curl or `ray job submit` here reaches the hosts. Shaping is per host, on its egress, as
# `tc netem` inside the host would apply it (the kernel's netem where it exists, else a
# userspace link emulator with netem's model). Nothing is routed beyond the cluster's /24.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-}" in
  ""|-h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
if [[ $(id -u) != 0 ]]; then
  echo "netns_cluster.sh: needs root (network namespaces, veth, bridge, tap)" >&2
  exit 2
fi
# launch/netns.py, netns_cli.py are standard library only: the venv's python when there is one, else python3.
PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || PY="$(command -v python3)"
cd "$ROOT"
exec "$PY" -m launch.netns_cli "$@"
