"""Names for the values whose type really is open, so that a signature says why it takes one.

Everywhere else a value has its own type (a class, a Protocol, a TypedDict, a pydantic
model); these are the few places where it is arbitrary by nature:

- :data:`StateDict`: what ``torch`` gives from ``state_dict()`` (tensors, numbers, nested
  dicts and lists, as the module or optimizer makes them);
- :data:`JsonObject`: a JSON or msgpack object from outside, before a model validates it;
- :data:`ConfigValues`: a run's or a task's configuration keys, checked by their schema;
- :data:`UserMetadata`: what a caller stores (a gossip value, its tensors' metadata) and
  gets back as it gave it.

Import only the standard library here: both sides of the wire use these names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

__all__ = ["ConfigValues", "JsonObject", "StateDict", "UserMetadata"]

StateDict: TypeAlias = dict[str, Any]
JsonObject: TypeAlias = dict[str, Any]
ConfigValues: TypeAlias = Mapping[str, Any]
UserMetadata: TypeAlias = Any
