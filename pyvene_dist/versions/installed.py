"""What is installed, read from the distributions' metadata, in the two forms the version guard uses.

``version`` is the distribution's version as its metadata gives it (``2.13.0+cpu``), for the floors and for
messages; ``release`` is the same release as the fingerprints table names it (``2.13.0``, or ``0.1.0+git.dafd099``
for a git checkout). Both ``guard`` and ``forms`` (the table) read them here, so that the
guard's calls go one way, down to this module, and a test replaces what is installed in one place."""

from __future__ import annotations

import json
from importlib import metadata

from packaging.version import Version


def version(distribution: str) -> str | None:
    """The installed version of ``distribution`` as its metadata gives it, or None where it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def release(distribution: str) -> str | None:
    """The installed release as the table names it: its public version (torch's ``+cpu`` left off), with
    ``+git.<commit>`` for one installed from a git checkout (PEP 610's ``direct_url.json``)."""
    try:
        found = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return None
    public = Version(found.version).public
    commit = json.loads(found.read_text("direct_url.json") or "{}").get("vcs_info", {}).get("commit_id")
    return f"{public}+git.{commit[:7]}" if commit else public
