# SPDX-License-Identifier: Apache-2.0
"""Build bex._bex against libbex (python/README.md, "Building").

Where libbex comes from, first match wins:
  BEX_BUILD_DIR=DIR   a CMake build dir of this checkout: links DIR/libbex.a
                      (the package then needs no libbex.so at run time)
  BEX_USE_PKGCONFIG=1 or no build dir found: an installed libbex, found by
                      pkg-config (bex.pc; PKG_CONFIG_PATH for a prefix), linked
                      as libbex.so with an rpath to its libdir
  ../build            the checkout's default build dir, when it has libbex.a
"""
import os
import re
import shlex
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """Always rebuild: pip reuses python/build/, and setuptools compares only
    the sources' times, not libbex's or which libbex (a stale module would
    keep an old library or the other linking)."""

    def finalize_options(self):
        super().finalize_options()
        self.force = True

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(HERE)
# what libbex itself links (bex.pc's Requires.private), for the static archive
PRIVATE = ["libibverbs", "libsodium", "jansson", "libcurl"]


def pkg_config(*args):
    try:
        out = subprocess.run(["pkg-config", *args], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", "") or str(e)
        sys.exit(f"bex: pkg-config {' '.join(args)} failed: {err.strip()}")
    return shlex.split(out.stdout)


def split_flags(flags):
    inc = [f[2:] for f in flags if f.startswith("-I")]
    libdirs = [f[2:] for f in flags if f.startswith("-L")]
    libs = [f[2:] for f in flags if f.startswith("-l")]
    return inc, libdirs, libs


def in_tree(build):
    archive = os.path.join(build, "libbex.a")
    if not os.path.exists(archive):
        sys.exit(f"bex: {archive} not found: build the library first "
                 f"(cmake -S {TOP} -B {build} && cmake --build {build})")
    _, libdirs, libs = split_flags(pkg_config("--libs", *PRIVATE))
    return dict(include_dirs=[os.path.join(TOP, "include"), os.path.join(build, "include")],
                extra_objects=[archive], library_dirs=libdirs,
                libraries=libs + ["pthread", "m"])


def installed():
    inc, libdirs, libs = split_flags(pkg_config("--cflags", "--libs", "bex"))
    libdirs = [os.path.normpath(d) for d in libdirs]
    return dict(include_dirs=inc, library_dirs=libdirs, libraries=libs,
                runtime_library_dirs=libdirs)


def where():
    build = os.environ.get("BEX_BUILD_DIR")
    if build:
        return "build dir " + build, in_tree(os.path.abspath(build))
    default = os.path.join(TOP, "build")
    if os.environ.get("BEX_USE_PKGCONFIG") != "1" and os.path.exists(
            os.path.join(default, "libbex.a")):
        return "build dir " + default, in_tree(default)
    return "pkg-config bex", installed()


def version(flags):
    for d in flags["include_dirs"]:
        p = os.path.join(d, "bex", "version.h")
        if os.path.exists(p):
            m = re.search(r'BEX_VERSION_STRING "([^"]+)"', open(p).read())
            if m:
                return m.group(1)
    sys.exit("bex: bex/version.h not found in " + " ".join(flags["include_dirs"]))


source, flags = where()
print(f"bex: building against {source}", file=sys.stderr)
setup(
    version=version(flags),
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension("bex._bex",
                  sources=["src/bexmodule.c", "src/buffers.c", "src/ps.c", "src/ps_async.c",
                           "src/rpc.c", "src/guard.c", "src/sock.c", "src/mem.c",
                           "src/pools.c"],
                  depends=["src/bexmod.h", "src/psclient.h"],
                  extra_compile_args=["-std=gnu11", "-Wall", "-Wextra", "-Werror",
                                      "-Wno-missing-field-initializers",
                                      "-Wno-cast-function-type"],
                  **flags)
    ],
)
