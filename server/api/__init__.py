"""HTTP layer: dependencies and thin routes over :mod:`server.services`."""

# Routers carry the full prefix themselves (rather than receiving it at include time), so a
# route's own ``path`` is the template clients see, which the metrics use as a label.
API_PREFIX = "/api/v1"
