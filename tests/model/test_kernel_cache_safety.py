"""The CPU kernel cache loads only what this user built (`cpu_kernels`, `cache_safety`).

Each attack plants a library at the path a fresh process would load (a planted
library's constructor writes a marker file: the marker proves whether it ran),
then a real process asks for the kernels; it reads /proc/self/maps to say which
library it mapped. The tests run as root: "another user" is `nobody`, via chown.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dpserve.model import cpu_kernels

pytestmark = pytest.mark.procs  # the C compiler, and a fresh process for each probe

_PROBE = (
    "import json\n"
    "from dpserve.model import cpu_kernels\n"
    "ok = cpu_kernels.available()\n"
    "maps = {line.split(None, 5)[5].strip() for line in open('/proc/self/maps')\n"
    "        if '.so' in line and len(line.split(None, 5)) == 6}\n"
    "print(json.dumps({'available': ok, 'maps': sorted(maps)}))\n")

_EVIL_C = ('#include <stdio.h>\n'
           '__attribute__((constructor)) static void planted(void) {\n'
           '    FILE *f = fopen(MARKER, "w"); if (f) { fputs("ran", f); fclose(f); }\n'
           '}\n')


@pytest.fixture(scope="module")
def compiler() -> str:
    found = cpu_kernels.find_compiler()
    assert found, "a C compiler is needed: make setup installs gcc"
    return found


@pytest.fixture(scope="module")
def built(tmp_path_factory, compiler) -> Path:
    """A good library, built once for the module (copied into each test's cache)."""
    return cpu_kernels.build(compiler, tmp_path_factory.mktemp("built"))


def _evil(tmp_path: Path, compiler: str) -> tuple[Path, Path]:
    """A planted library whose constructor writes `marker`: (library, marker)."""
    src, lib, marker = tmp_path / "evil.c", tmp_path / "evil.so", tmp_path / "marker"
    src.write_text(_EVIL_C)
    subprocess.run([compiler, "-shared", "-fPIC", f'-DMARKER="{marker}"', str(src), "-o",
                    str(lib)], check=True, capture_output=True, timeout=120)
    return lib, marker


def _probe(cache: Path) -> tuple[dict, str]:
    """A fresh process loads the kernels with `cache` as its kernel cache."""
    env = {**os.environ, cpu_kernels.CACHE_ENV: str(cache)}
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _kernels_mapped(result: dict) -> list[str]:
    return [m for m in result["maps"] if "dpserve_kernels-" in m or "evil" in m]


def _nobody() -> int:
    return pwd.getpwnam("nobody").pw_uid


def test_a_good_cache_loads_without_a_rebuild(tmp_path, built, compiler):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    target = cpu_kernels.library_path(compiler, cache)
    shutil.copy2(built, target)
    before = os.stat(target)
    result, stderr = _probe(cache)
    assert result["available"] and _kernels_mapped(result) == [str(target)]
    after = os.stat(target)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert "not loading" not in stderr


def test_a_new_cache_directory_is_private(tmp_path, compiler):
    cache = tmp_path / "a" / "cache"
    result, _ = _probe(cache)
    assert result["available"]
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    library = cpu_kernels.library_path(compiler, cache)
    assert _kernels_mapped(result) == [str(library)]
    assert stat.S_IMODE(library.stat().st_mode) & 0o022 == 0


@pytest.mark.parametrize("unsafe", ["world-writable", "owned by nobody"])
def test_an_unsafe_cache_directory_is_not_loaded_from(tmp_path, compiler, unsafe):
    """A planted library at the exact path, in a directory others can write to (or
    that another user owns): not loaded; the kernels come from a private temporary
    build, and the planted file is left as it was."""
    cache = tmp_path / "cache"
    cache.mkdir()
    evil, marker = _evil(tmp_path, compiler)
    target = cpu_kernels.library_path(compiler, cache)
    shutil.copy2(evil, target)
    if unsafe == "world-writable":
        cache.chmod(0o777)
    else:
        os.chown(cache, _nobody(), -1)
    planted = os.stat(target)
    result, stderr = _probe(cache)
    assert not marker.exists(), "the planted library ran"
    assert result["available"]
    mapped = _kernels_mapped(result)
    assert len(mapped) == 1 and str(cache) not in mapped[0], mapped
    assert "dpserve-kernels-" in mapped[0] and mapped[0].endswith("(deleted)")
    assert stderr.count(f"the kernel cache {cache} is") == 1
    assert ("writable by group or others (mode 777)" if unsafe == "world-writable"
            else f"owned by uid {_nobody()}") in stderr
    assert os.stat(target).st_ino == planted.st_ino  # untouched


@pytest.mark.parametrize("plant", ["symlink", "owned by nobody", "group-writable"])
def test_an_untrusted_cached_library_is_rebuilt_not_loaded(tmp_path, compiler, plant):
    """A private cache whose library is a symlink (to a planted library), another
    user's file or one others can write: not loaded; built again over it."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    evil, marker = _evil(tmp_path, compiler)
    target = cpu_kernels.library_path(compiler, cache)
    if plant == "symlink":
        target.symlink_to(evil)
    else:
        shutil.copy2(evil, target)
        if plant == "owned by nobody":
            os.chown(target, _nobody(), -1)
        else:
            target.chmod(0o775)
    planted = os.stat(evil)
    result, stderr = _probe(cache)
    assert not marker.exists(), "the planted library ran"
    assert result["available"] and _kernels_mapped(result) == [str(target)]
    st = os.lstat(target)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) & 0o022 == 0
    assert f"not loading {target}" in stderr
    assert (os.stat(evil).st_ino, os.stat(evil).st_mtime_ns) == (planted.st_ino,
                                                                  planted.st_mtime_ns)
    assert sorted(p.name for p in cache.iterdir()) == [target.name]  # no temporary left
