"""``trtc bench``: every backend of a build, timed on identical inputs."""
