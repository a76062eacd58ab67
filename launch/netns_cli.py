"""`launch/netns_cluster.sh`: make, use and remove test clusters (launch/netns.py) from a shell.
Standard library only (it runs on the system python)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from launch.netns import (DEFAULT_MTU, STATE_DIR, NetnsCluster, clean_stale, cluster_states, load_cluster,
                          teardown_state, unavailable_reason)
from launch.shaping import Shaping, parse_duration_ms, parse_rate


def _shaping_from_args(args) -> Shaping | None:
    if not (args.delay or args.rate):
        return None
    return Shaping(delay_ms=parse_duration_ms(args.delay or "0"), jitter_ms=parse_duration_ms(args.jitter or "0"),
                   rate_bps=parse_rate(args.rate) if args.rate else None, limit=args.limit)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launch/netns_cluster.sh",
                                description="Test hosts in network namespaces on one bridge (root only).")
    sub = p.add_subparsers(dest="cmd", required=True)

    def shaping_flags(sp):
        sp.add_argument("--delay", help="egress delay per host, e.g. 2ms")
        sp.add_argument("--jitter", help="uniform jitter, e.g. 1ms (needs --delay)")
        sp.add_argument("--rate", help="egress rate per host, e.g. 1gbit")
        sp.add_argument("--limit", type=int, default=1000, help="queue limit in frames (netem's limit)")

    up = sub.add_parser("up", help="create NAME with N hosts a, b, ...")
    up.add_argument("name")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--root-link", action="store_true",
                    help="give the root namespace an address on the bridge (to reach the hosts from here)")
    up.add_argument("--mtu", type=int, default=DEFAULT_MTU)
    up.add_argument("--shaper", choices=("auto", "netem", "wire"), default="auto")
    up.add_argument("--shapeable", action="store_true", help="allow `shape` later even if created unshaped")
    shaping_flags(up)
    ex = sub.add_parser("exec", help="run a command inside a host: exec NAME HOST -- CMD ...")
    ex.add_argument("name")
    ex.add_argument("host")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    sh = sub.add_parser("shape", help="change a host's egress shaping (no flags: none)")
    sh.add_argument("name")
    sh.add_argument("host", help="a host label, or all")
    shaping_flags(sh)
    for cmd, text in (("cut", "unplug a host from the bridge"), ("restore", "plug it back")):
        c = sub.add_parser(cmd, help=text)
        c.add_argument("name")
        c.add_argument("host")
    st = sub.add_parser("status", help="list clusters (or one)")
    st.add_argument("name", nargs="?")
    dn = sub.add_parser("down", help="stop every process in NAME's hosts and delete it")
    dn.add_argument("name", nargs="?")
    dn.add_argument("--all", action="store_true", help="every cluster made by this tool")
    sub.add_parser("clean", help="remove clusters left by crashed test runs")
    args = p.parse_args(argv)

    reason = unavailable_reason()
    if reason:
        print(f"netns_cluster: {reason}", file=sys.stderr)
        return 2
    try:
        if args.cmd == "up":
            net = NetnsCluster(args.hosts, shaping=_shaping_from_args(args), root_link=args.root_link, mtu=args.mtu,
                               shaper=args.shaper, tag=args.name, persistent=True,
                               shapeable=args.shapeable or None)
            net.start()
            print(net.describe())
            print(f"run in a host:  launch/netns_cluster.sh exec {args.name} a -- COMMAND")
            print(f"remove it:      launch/netns_cluster.sh down {args.name}")
        elif args.cmd == "exec":
            net = load_cluster(args.name)
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                p.error("exec needs a command after --")
            os.execvp("ip", [*net.exec_prefix(args.host), *command])
        elif args.cmd == "shape":
            net = load_cluster(args.name)
            for h in (net.hosts if args.host == "all" else [net.host(args.host)]):
                net.shape(h, _shaping_from_args(args))
            print(net.describe())
        elif args.cmd in ("cut", "restore"):
            net = load_cluster(args.name)
            getattr(net, args.cmd)(args.host)
        elif args.cmd == "status":
            tags = [args.name] if args.name else [s["tag"] for s in cluster_states()]
            for tag in tags:
                net = load_cluster(tag)
                owner = "" if net.persistent else " (a test run's)"
                print(net.describe() + owner)
            if not tags:
                print("no clusters")
        elif args.cmd == "down":
            if not args.all and not args.name:
                p.error("down needs NAME or --all")
            tags = [s["tag"] for s in cluster_states()] if args.all else [args.name]
            for tag in tags:
                state_path = STATE_DIR / f"{tag}.json"
                if not state_path.exists():
                    raise RuntimeError(f"no cluster named {tag!r}")
                problems = teardown_state(json.loads(state_path.read_text()))
                print(f"{tag}: removed" + (f" (left: {'; '.join(problems)})" if problems else ""))
        elif args.cmd == "clean":
            removed = clean_stale()
            print(f"removed: {', '.join(removed)}" if removed else "nothing stale")
    except (RuntimeError, ValueError, KeyError) as e:
        print(f"netns_cluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
