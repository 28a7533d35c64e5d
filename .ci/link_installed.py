"""Link an installed distribution's files from one environment into this one (same Python): hard links, so
the wheel is not unpacked and byte-compiled a second time.

    ENV/bin/python .ci/link_installed.py FROM_ENV DIST [DIST ...]

CI builds two environments with the same torch wheel (megatron-core 0.16.1 and 0.19.2 cannot share one);
unpacking it again cost about 30 s of CPU while the README's command 1 trains on the same 2 cores. Links
every file under the top-level directories the distribution's RECORD names (its package directories and
its .dist-info, byte-compiled files included), and nothing outside site-packages (its console scripts name
the other environment's interpreter). Exit 1 without linking anything when FROM_ENV lacks a DIST or the
two environments are on different file systems; the caller installs them the usual way either way (pip
then finds them satisfied).
"""

from __future__ import annotations

import glob
import os
import re
import sys
import sysconfig


def site_packages(env: str) -> str:
    found = glob.glob(os.path.join(env, "lib", "python*", "site-packages"))
    if len(found) != 1:
        raise SystemExit(f"link_installed: no single site-packages under {env}")
    return found[0]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def record_of(source: str, dist: str) -> str | None:
    """The RECORD of ``dist`` in the site-packages ``source`` (names compared as pip normalises them)."""
    for info in glob.glob(os.path.join(source, "*.dist-info")):
        if normalized(os.path.basename(info).removesuffix(".dist-info").split("-")[0]) == normalized(dist):
            record = os.path.join(info, "RECORD")
            return record if os.path.isfile(record) else None
    return None


def top_levels(record: str) -> set[str]:
    tops = set()
    with open(record) as lines:
        for line in lines:
            first = line.rsplit(",", 2)[0].split("/")[0]
            if first and first != "..":
                tops.add(first)
    return tops


def link(source: str, target: str, top: str) -> int:
    """Hard-link ``source/top`` (a directory or a single module file) into ``target``; the files linked."""
    path = os.path.join(source, top)
    if os.path.isfile(path):
        destination = os.path.join(target, top)
        if os.path.exists(destination):
            return 0
        os.link(path, destination)
        return 1
    linked = 0
    for directory, _, files in os.walk(path):
        destination = os.path.join(target, os.path.relpath(directory, source))
        os.makedirs(destination, exist_ok=True)
        for name in files:
            if not os.path.exists(os.path.join(destination, name)):
                os.link(os.path.join(directory, name), os.path.join(destination, name))
                linked += 1
    return linked


def main(source_env: str, *dists: str) -> int:
    source = site_packages(source_env)
    target = sysconfig.get_paths()["purelib"]
    records = {dist: record_of(source, dist) for dist in dists}
    missing = [dist for dist, record in records.items() if record is None]
    if missing:
        print(f"link_installed: not installed in {source_env}: {', '.join(missing)}", file=sys.stderr)
        return 1
    if os.stat(source).st_dev != os.stat(target).st_dev:
        print("link_installed: the environments are on different file systems", file=sys.stderr)
        return 1
    present = [dist for dist in dists if record_of(target, dist) is not None]  # never mix two versions' files
    linked = sum(link(source, target, top) for dist, record in records.items() if dist not in present
                 for top in sorted(top_levels(record)))
    print(f"link_installed: {linked} files of {', '.join(d for d in dists if d not in present)} linked from "
          f"{source_env}" + (f" ({', '.join(present)} already installed)" if present else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
