"""The admin token every server that guards its mutating routes takes (a worker's system
server, the frontend's cancel route): from one of --admin-token, --admin-token-file or
$RLFLEET_ADMIN_TOKEN."""

from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger("rlfleet.auth")


def settle_admin_token(args: argparse.Namespace) -> None:
    """The admin token ends in `args.admin_token`, from --admin-token, --admin-token-file or
    $RLFLEET_ADMIN_TOKEN (one of them); ValueError says what to change."""
    given = [n for n, v in (("--admin-token", args.admin_token),
                            ("--admin-token-file", args.admin_token_file)) if v]
    if len(given) > 1:
        raise ValueError("give the admin token one way: --admin-token or --admin-token-file")
    if args.admin_token_file:
        try:
            token = open(args.admin_token_file, encoding="utf-8").read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--admin-token-file {args.admin_token_file}: cannot read it ({e})") \
                from e
        if not token:
            raise ValueError(f"--admin-token-file {args.admin_token_file} is empty")
        args.admin_token = token
    elif args.admin_token:
        log.warning("--admin-token on the command line is visible to every user of this host "
                    "(ps, /proc): prefer --admin-token-file or $RLFLEET_ADMIN_TOKEN")
    else:
        args.admin_token = os.environ.get("RLFLEET_ADMIN_TOKEN") or None
    args.admin_token_file = None
