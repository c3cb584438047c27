"""``kvfleet ROLE [args]``: one entry point (and one container image) for every role.

Each role is a module with a ``main(argv) -> int`` function, imported only when
that role is asked for, so ``kvfleet epp`` never imports kopf and
``kvfleet operator`` never imports grpc.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

#: role name -> (module, help). The module exposes ``main(argv: list[str]) -> int``.
ROLES: dict[str, tuple[str, str]] = {
    "operator": ("kvfleet.operator.main", "run the kopf operator (KVCachePool, InferencePool)"),
    "epp": ("kvfleet.epp.main", "run the Envoy ext_proc endpoint picker"),
    "gateway-config": ("kvfleet.epp.envoy", "write the Envoy gateway configuration in front of the EPP"),
    "gateway-extension": ("kvfleet.epp.gateway_extension",
                          "serve Envoy Gateway's extension hooks: InferencePool routes through the EPP"),
    "agent": ("kvfleet.agent.main", "run the node agent (tiers, transfer engine, KV events)"),
    "engine": ("kvfleet.engine.main", "run the CPU-fallback engine simulator (OpenAI API)"),
    "demo": ("kvfleet.demo.main", "run the one-machine stack and replay a workload"),
}


def _usage() -> str:
    lines = ["usage: kvfleet ROLE [options]", "", "roles:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in ROLES.items()]
    lines += ["", "`kvfleet ROLE --help` shows the options of one role."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        from kvfleet import __version__

        print(f"kvfleet {__version__}")
        return 0
    role, rest = args[0], args[1:]
    if role not in ROLES:
        print(f"kvfleet: unknown role {role!r}; known roles: {', '.join(ROLES)}", file=sys.stderr)
        return 2
    module_name, _ = ROLES[role]
    from kvfleet.cache import malloc, threadnames

    threadnames.configure()  # before any role starts a thread: each names itself to the kernel
    malloc.configure()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("kvfleet"):
            print(f"kvfleet: role {role!r} is not available in this build ({exc.name})", file=sys.stderr)
            return 2
        print(f"kvfleet: role {role!r} needs the Python package {exc.name!r}: pip install 'kvfleet[local]'",
              file=sys.stderr)
        return 2
    rc: int = module.main(rest)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
