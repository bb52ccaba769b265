"""The commands that write build directories: export, build, check/rebuild/merge, Triton."""
