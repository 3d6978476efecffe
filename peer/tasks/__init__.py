"""Built-in training tasks that need no download (see :mod:`peer.tasks.digits`)."""
