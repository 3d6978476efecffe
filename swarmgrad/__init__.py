"""The ``swarmgrad`` command line, a thin layer over :mod:`peer` and the coordinator's REST API.

Modules: :mod:`swarmgrad.cli` (the root command and its error discipline),
:mod:`swarmgrad.organizer` (``runs ...`` and ``invite``: calls through
:class:`peer.coordinator.CoordinatorClient`), :mod:`swarmgrad.join` (``join``: a
:class:`peer.volunteer.Volunteer` with a progress display), :mod:`swarmgrad.local`
(a coordinator and volunteers as local child processes that never outlive their parent) and
:mod:`swarmgrad.demo` (``demo``: all of it on one machine); :mod:`swarmgrad.errors` lists the
command line's own exceptions.

Nothing here imports ``server`` except ``swarmgrad coordinator``, when it runs.
"""
