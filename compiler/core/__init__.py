"""Errors, files (atomic writes, the directory transaction), input specs, settings, profiles, manifest."""
