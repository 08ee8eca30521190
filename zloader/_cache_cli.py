"""``zloader cache ls|rm``: the command line of the entries ``Pipeline.cache()`` writes
(docs/cache.md); ``zloader.cli`` adds :func:`cache_parser` to its subcommands."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from zloader._defaults import CACHE_STALE_SECONDS

__all__ = ["cache_parser"]


def cache_parser(commands: Any) -> None:
    cache = commands.add_parser(
        "cache", help="show or clear the entries of Pipeline.cache()",
        description="The entries Pipeline.cache() wrote at a cache location: one folder per "
                    "fingerprint of the stages before .cache(), one entry per split read "
                    "to its end (docs/cache.md). PATH is a folder or an fsspec URL; by "
                    "default $ZLOADER_CACHE_DIR, else ~/.cache/zloader/cache.")
    verbs = cache.add_subparsers(dest="verb", metavar="VERB", required=True)
    ls = verbs.add_parser(
        "ls", help="list the cached prefixes",
        description="List each cached prefix at PATH: its fingerprint, the splits "
                    "committed, their bytes, when an entry was last written, and temporary "
                    "files (writers under way, or killed midway).")
    rm = verbs.add_parser(
        "rm", help="remove entries",
        description="Remove the entries (and temporary files) of one fingerprint, or of "
                    "all, or only the temporary files that writers killed midway left.")
    for verb in (ls, rm):
        verb.add_argument("path", metavar="PATH", nargs="?", default=None,
                          help="the cache location (default: the per-user cache folder)")
        verb.add_argument("--storage-options", metavar="JSON", type=json.loads, default=None,
                          help="fsspec's options for a URL's filesystem, as a JSON object")
    ls.add_argument("--json", action="store_true", help="print a JSON list, one object per "
                    "fingerprint")
    ls.set_defaults(run=_cache_ls)
    which = rm.add_mutually_exclusive_group(required=True)
    which.add_argument("--fingerprint", metavar="F",
                       help="the fingerprint whose entries to remove (a unique prefix of it "
                            "is enough; `zloader cache ls` lists them)")
    which.add_argument("--all", action="store_true", help="remove every entry at PATH")
    which.add_argument("--stale", action="store_true",
                       help="remove only temporary files untouched for --older-than seconds")
    rm.add_argument("--older-than", type=float, default=CACHE_STALE_SECONDS, metavar="S",
                    help=f"with --stale: seconds (default {CACHE_STALE_SECONDS:g})")
    rm.set_defaults(run=_cache_rm)


def _cache_store(args: argparse.Namespace) -> Any:
    from zloader.cache import location
    from zloader.cachefile import Store

    if args.storage_options is not None and not isinstance(args.storage_options, dict):
        raise SystemExit("zloader cache: --storage-options must be a JSON object")
    return Store(location(args.path), args.storage_options)


def _cache_ls(args: argparse.Namespace) -> int:
    from zloader.cache import summaries

    store = _cache_store(args)
    try:
        found = summaries(store)
    except OSError as exc:  # no folder there (FileNotFoundError), or it cannot be read
        print(f"zloader cache ls: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([s.to_dict() for s in found]))
        return 0
    if not found:
        print(f"no cache entries at {store.root}")
        return 0
    print(f"{'fingerprint':<64}  {'splits':>6}  {'bytes':>12}  {'last written':<19}  temp")
    for s in found:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.last_written))
        print(f"{s.fingerprint:<64}  {s.splits:>6}  {s.bytes:>12,}  {when:<19}  "
              f"{s.temporary}")
    return 0


def _cache_rm(args: argparse.Namespace) -> int:
    from zloader.cache import remove

    store = _cache_store(args)
    try:
        removed = remove(store, fingerprint=args.fingerprint, everything=args.all,
                         stale=args.older_than if args.stale else None)
    except (ValueError, LookupError, OSError) as exc:  # OSError: no folder, or unreadable
        print(f"zloader cache rm: {exc}", file=sys.stderr)
        return 2
    keys = {f.fingerprint for f in removed}
    print(f"removed {len(removed)} files of {len(keys)} fingerprints at {store.root}")
    return 0
