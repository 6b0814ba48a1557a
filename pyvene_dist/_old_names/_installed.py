"""Moved to ``pyvene_dist.versions.installed``: import it from there (this name goes in a later release)."""

from pyvene_dist._moved_modules import forward

forward(__name__)
