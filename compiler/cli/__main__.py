"""``python -m compiler.cli``: the ``trtc`` command."""

from compiler.cli import main

main()
