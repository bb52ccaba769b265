"""trtc's version, at the bottom so that every layer can record it (the manifest, bench reports)."""

__version__ = "0.1.0"
