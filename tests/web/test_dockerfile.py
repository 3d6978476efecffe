"""The Dockerfile's image installs a working coordinator, checked without a container engine:
the files its COPY lines name (parsed from it) are assembled in an empty directory, the wheel
is built from them alone, installed in a fresh virtual environment, and the installed
coordinator serves a page and a static file from its own copy."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.conftest import scaled

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "Dockerfile"


def copy_lines(dockerfile: str) -> list[tuple[list[str], str]]:
    """``(sources, destination)`` of each ``COPY`` instruction (continuation lines joined);
    a ``COPY --from`` (another stage) or other flag is refused: this test would not see it."""
    joined = dockerfile.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if not words or words[0].upper() != "COPY":
            continue
        if any(w.startswith("--") for w in words[1:]):
            raise ValueError(f"unsupported COPY flags: {line.strip()}")
        if len(words) < 3:
            raise ValueError(f"COPY needs a source and a destination: {line.strip()}")
        found.append((words[1:-1], words[-1]))
    return found


def assemble(dockerfile: str, root: Path, into: Path) -> None:
    """Copy what the COPY lines copy (relative to WORKDIR /app, i.e. ``into``)."""
    for sources, destination in copy_lines(dockerfile):
        for source in sources:
            origin = root / source
            if not origin.exists():
                raise FileNotFoundError(f"COPY {source}: not in the build context")
            if (destination.endswith("/") and len(sources) > 1) or destination in ("./", "."):
                target = into / destination / origin.name
            else:
                target = into / destination
            if origin.is_dir():
                shutil.copytree(
                    origin, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
                )
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target)


def test_copy_lines_are_parsed() -> None:
    text = "FROM x\nCOPY a b ./\n# COPY c ./c\nCOPY d \\\n  ./d\nRUN cp x y\n"
    assert copy_lines(text) == [(["a", "b"], "./"), (["d"], "./d")]
    with pytest.raises(ValueError, match="unsupported"):
        copy_lines("COPY --from=build /x /y\n")


@pytest.mark.slow  # a wheel build, a fresh environment and an app: 4 s idle, more under load
def test_the_image_files_build_a_wheel_that_serves_pages(tmp_path: Path) -> None:
    context = tmp_path / "app"
    context.mkdir()
    assemble(DOCKERFILE.read_text(), REPO_ROOT, context)
    dist = tmp_path / "dist"
    built = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"),
            *("--no-build-isolation", "--wheel-dir", str(dist), str(context)),
        ],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("swarmgrad-*.whl")

    fresh = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(fresh)
    python = fresh / "bin" / "python"
    installed = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"),
            *("--no-deps", "--no-index", str(wheel)),
        ],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert installed.returncode == 0, installed.stderr
    # The dependencies come from this environment's site-packages, appended after the fresh
    # one's: a path in a .pth file does not run that directory's own .pth files, so the
    # repository's editable install stays out of sight.
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (purelib / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    script = """
import sys, tempfile, server
from fastapi.testclient import TestClient
from server.app import create_app
from server.config import Settings
with tempfile.TemporaryDirectory() as d:
    settings = Settings(environment="production", database_url=f"sqlite:///{d}/c.db",
                        secret_key="k" * 43, checkpoint_dir=f"{d}/ckpt", spill_dir=f"{d}/spill")
    with TestClient(create_app(settings)) as client:
        page = client.get("/", headers={"Accept": "text/html"})
        css = client.get("/static/css/app.css")
        js = client.get("/static/js/format.js")
        print(server.__file__)
        print(page.status_code, "<h1>Runs</h1>" in page.text)
        print(css.status_code, css.headers["content-type"].split(";")[0])
        print(js.status_code, "export function" in js.text)
"""
    served = subprocess.run(
        [str(python), "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=scaled(120),
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert served.returncode == 0, served.stderr
    module, page, css, js = served.stdout.strip().splitlines()[-4:]
    assert Path(module).is_relative_to(fresh), module  # the wheel's copy, not the repository
    assert page == "200 True"
    assert css == "200 text/css"
    assert js == "200 True"
