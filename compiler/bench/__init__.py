"""``trtc bench``: every backend of a build, timed on identical inputs.

The entry points are ``harness.bench_directory`` and ``harness.bench_model``; the harness's docstring lists
the file that does each step.
"""
