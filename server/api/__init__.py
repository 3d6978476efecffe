"""HTTP layer: dependencies and thin routes over :mod:`server.services`."""
