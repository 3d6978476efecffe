"""A pure-Python wheel built by hand, for pip to install with no network
(``PIP_NO_INDEX=1 PIP_FIND_LINKS=<its directory>``): what shipped tasks' requirements are
tested with."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def build_wheel(directory: Path, name: str, source: str, version: str = "0.1") -> Path:
    """``<directory>/<name>-<version>-py3-none-any.whl`` holding the package ``name`` whose
    ``__init__.py`` is ``source``."""
    dist = f"{name}-{version}"
    files = {
        f"{name}/__init__.py": source,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel
