"""`python -m workers serve | join | sample | status | stop | keys` (contract P in docs/architecture.md).

`status`, `stop` and `keys` import neither torch nor diffusers (asking a pool how it is must not cost a model
library's import); the commands that start or use ranks are in pool_commands.py, imported when they run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .client import PoolClient, PoolRefused, PoolUnreachable
from .engine import ArgumentParser, LayoutError
from .wire import auth

LIGHT = ("status", "stop", "keys")


INSECURE_HELP = ("no CURVE keys: anyone who can connect to the endpoint (every user of this machine, on loopback) "
                 "could submit jobs on its GPUs, read its status and stop it")


def _client_keys_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--curve-dir", default=None,
                        help=f"folder with a pool's server.key and an allowed client.key_secret, for a pool served with "
                             f"--curve-dir (default: your own keys, ${auth.ENV} or ~/.cache/xdit-pool/keys, which the "
                             "pools you start use)")
    parser.add_argument("--insecure-tcp", action="store_true",
                        help=f"reach a pool served with --insecure-tcp, whose endpoint has {INSECURE_HELP}")


def build_parser(light: bool = False) -> argparse.ArgumentParser:
    """Every command's parser; `light`: only status, stop and keys (no engine import)."""
    parser = ArgumentParser(prog="python -m workers", description="xDiT pool: persistent parallel sampling")
    commands = parser.add_subparsers(dest="command", required=True)
    if not light:
        from . import pool_commands

        pool_commands.add_parsers(commands, _client_keys_argument, INSECURE_HELP)

    keys = commands.add_parser("keys", help="create CURVE keys for a pool reachable from other machines (pools on "
                                            "loopback use your own, made on first use)")
    keys.add_argument("--out", required=True, help="a new folder for the keys")

    for name, text in (("status", "print the pool's status"), ("stop", "stop a pool")):
        command = commands.add_parser(name, help=text)
        command.add_argument("--endpoint", required=True)
        _client_keys_argument(command)
        if name == "status":
            command.add_argument("--json", action="store_true")
            command.add_argument("--wait", nargs="?", const="idle", choices=["idle", "busy"], default=None,
                                 help="wait until the pool is in this state (default: idle), then print")
    return parser


def keys(args) -> int:
    written = auth.create_keys(args.out)
    print(f"wrote {len(written)} key files (mode 0600) to {args.out}\n"
          f"  pool:    python -m workers serve --curve-dir {args.out} --endpoint tcp://0.0.0.0:5599 ...\n"
          f"  clients: copy {args.out}/server.key and {args.out}/client.key_secret into a folder, then pass "
          f"--curve-dir FOLDER (or set {auth.ENV}=FOLDER)")
    return 0


def status(args) -> int:
    with PoolClient(args.endpoint, curve_dir=args.curve_dir, insecure=args.insecure_tcp) as client:
        try:
            info = (client.wait_for_state(args.wait, timeout_s=600) if args.wait else client.status()).params()
        except PoolRefused:
            raise  # not a state of the pool: this client may not ask (main prints the one line)
        except PoolUnreachable as error:
            info = {"state": "unreachable", "error": str(error)}
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            if key == "layout_auto" and value:
                print(f"{key}: link {value['link']}, now {value['current']}")
                last = value["last"]
                for line in [f"chose [{last['layout']}] for {last['job']}; predicted per step:", *last["table"]] if last else []:
                    print(f"  {line}")
            else:
                print(f"{key}: {value}")
    return 0 if info["state"] != "unreachable" else 1


def stop(args) -> int:
    with PoolClient(args.endpoint, curve_dir=args.curve_dir, insecure=args.insecure_tcp) as client:
        client.stop()
    print(f"xdit: asked the pool at {args.endpoint} to stop", flush=True)
    return 0


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    light = bool(argv) and argv[0] in LIGHT
    args = build_parser(light).parse_args(argv)
    try:
        if light:
            return {"status": status, "stop": stop, "keys": keys}[args.command](args)
        from . import pool_commands

        return {"serve": pool_commands.serve, "join": pool_commands.join, "sample": pool_commands.sample}[args.command](args)
    except (LayoutError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except PoolUnreachable as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
