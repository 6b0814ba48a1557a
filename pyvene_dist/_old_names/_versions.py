"""Moved to ``pyvene_dist.versions.guard``: import it from there (this name goes in a later release)."""

from pyvene_dist._moved_modules import forward

forward(__name__)
